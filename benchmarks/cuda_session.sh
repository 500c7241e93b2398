#!/usr/bin/env bash
# Every CUDA measurement of the engine in one device lease (the device tool runs it from the
# repo root; results land in $OUT). Needs only what the GPU image has, plus the tokenizer
# files carried in .carry/tokenizer (presets use SmolLM2's tokenizer for text).
#   bash benchmarks/cuda_session.sh            # all steps
#   STEPS="parity graphs" bash benchmarks/cuda_session.sh
set -uo pipefail
export PYTHONPATH="$PWD:$PWD/protos" PYTHONUNBUFFERED=1 BATON_PRESET_TOKENIZER="$PWD/.carry/tokenizer"
OUT=${OUT:-bench-results/cuda}; mkdir -p "$OUT"
STEPS=${STEPS:-"kernels parity graphs profile b1 b1s b1hf b1big"}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
for step in $STEPS; do
  echo "=== $step $(date +%T)"
  case $step in
    kernels) timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_platform_cuda.py 2>&1 \
              | tail -30 | tee "$OUT/kernels.txt" ;;
    parity) BATON_TEST_DEVICE=cuda:0 timeout 180 python3 -m pytest -q -p no:cacheprovider tests/test_engine.py \
              -k tiny_architectures 2>&1 | tail -4 | tee "$OUT/parity.txt" ;;
    graphs) timeout 240 python3 -m benchmarks.decode_graphs --model qwen3-0.6b --batches 1,64,256 --breakdown \
              2>"$OUT/graphs.log" | tee "$OUT/graphs.jsonl" ;;
    profile) timeout 150 python3 -m benchmarks.profile_steps --model qwen3-0.6b --batch 256 --context 512 \
              2>"$OUT/profile.log" | tee "$OUT/profile.jsonl" ;;
    b1)     timeout 200 python3 -m engine.cli bench offline --model qwen3-0.6b --device cuda:0 \
              --output "$OUT/b1-qwen3-0.6b-baton.json" 2>&1 | tail -15 ;;
    b1s)    timeout 120 python3 -m engine.cli bench offline --model qwen3-0.6b --device cuda:0 --num-seqs 64 \
              --output "$OUT/b1-qwen3-0.6b-baton-64.json" 2>&1 | tail -15 ;;
    b1hf)   timeout 240 python3 -m engine.cli bench offline --engine transformers --model qwen3-0.6b \
              --device cuda:0 --num-seqs 64 --output "$OUT/b1-qwen3-0.6b-transformers-64.json" 2>&1 | tail -15 ;;
    b1big)  timeout 240 python3 -m engine.cli bench offline --model qwen3-8b --device cuda:0 \
              --output "$OUT/b1-qwen3-8b-baton.json" 2>&1 | tail -15 ;;
  esac
done
