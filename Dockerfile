# Baton: one image for the router and every worker; `baton` is its entry point, docker-compose and
# Kubernetes pick the command (`prefill ...`, `decode ...`, `router ...`; default `serve`). It runs
# as the unprivileged user baton (uid 1000); Hub models go to the HF cache volume (HF_HOME).
# CPU by default; for NVIDIA GPUs (what compose's gpu profile passes):
#   docker build --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 --build-arg WITH_COMPILER=1 .
# Triton compiles its launcher with the system C compiler at a kernel's first launch, so
# the GPU image carries gcc; the CPU image does not need it.
FROM python:3.11.11-slim-bookworm

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG WITH_COMPILER=0
ARG EXTRAS=""
# (build args reach deploy/install-runtime.sh as environment variables; pip keeps no cache in a layer)
ENV PYTHONUNBUFFERED=1 \
    BATON_CACHE_DIR=/opt/baton-cache \
    HF_HOME=/var/cache/huggingface \
    TOKENIZERS_PARALLELISM=false \
    PIP_NO_CACHE_DIR=1

# The sources are built in /src and removed once installed: in their folder, `python -m baton.x`
# would import the source folder baton/ (which links the others) instead of the installed package.
WORKDIR /src
RUN if [ "$WITH_COMPILER" = "1" ]; then \
      apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*; \
    fi
# torch in a layer of its own: a change to the code does not reinstall it
COPY deploy/install-runtime.sh deploy/
RUN sh deploy/install-runtime.sh python --torch-only
COPY pyproject.toml README.md LICENSE ./
COPY baton baton
COPY protos protos
COPY serving serving
COPY router router
COPY prefill_service prefill_service
COPY decode_service decode_service
COPY kvtransfer kvtransfer
COPY engine engine
COPY models models
COPY benchmarks benchmarks
RUN sh deploy/install-runtime.sh python && rm -rf /src
WORKDIR /app
# fetch and convert the embedded model once, at build time, so containers start fast (into the
# services' --cache-dir: resolve_model's own default is ~/.cache/baton)
RUN python -c "import os; from baton.models.source import resolve_model; resolve_model(None, os.environ['BATON_CACHE_DIR'])"
# not root: the caches it writes (compiled graphs, Hub downloads) are the user's
RUN useradd --uid 1000 --create-home --shell /usr/sbin/nologin baton \
    && mkdir -p "$HF_HOME" && chown -R baton:baton "$BATON_CACHE_DIR" "$HF_HOME" /app
USER baton
# Hub models (baton serve ORG/NAME) are downloaded here: mount a volume to keep them across containers
VOLUME ["/var/cache/huggingface"]

EXPOSE 50051 8000
ENTRYPOINT ["baton"]
CMD ["serve", "--host", "0.0.0.0"]
