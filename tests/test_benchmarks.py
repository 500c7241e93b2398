"""The benchmark harness: its numbers are computed as BENCHMARKS.md defines them (checked on
hand-computed cases), and each `--smoke` mode runs end to end on the CPU and writes its JSON.
Timings are never asserted: only that they exist and add up."""
from __future__ import annotations

import dataclasses
import json
import math
import random
import subprocess
import sys

import pytest
from cluster import REPO

from baton.benchmarks import datasets, loadgen, prometheus, record
from baton.benchmarks.kv import payload_bytes
from baton.benchmarks.model_shape import ModelShape
from baton.benchmarks.roofline import Ceilings, CostModel, StepShape, roofline_report
from baton.benchmarks.schedule_sim import simulate_steps
from baton.benchmarks.serve import parse_rates, summarize_rate
from baton.benchmarks.stats import (
    attainment,
    goodput_rate,
    histogram_quantile,
    meets_slo,
    percentile,
    summarize,
    tpot,
)
from baton.benchmarks.workload import nano_vllm_workload

BENCH = [sys.executable, "-m", "baton", "bench"]


# -- statistics ------------------------------------------------------------------------------------
class _CountingEngine:
    """An engine stand-in for the speculative benchmark's drivers: each step gives every running
    request `per_step` tokens (token = its index), a request finishes at `length` tokens."""

    def __init__(self, per_step: int, length: int = 7):
        self.per_step, self.length, self.running, self.steps, self.ids = per_step, length, {}, 0, 0

    def add_request(self, prompt, params) -> str:
        self.ids += 1
        self.running[str(self.ids)] = 0
        return str(self.ids)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.running)

    def step(self):
        self.steps += 1
        outs = []
        for rid, done in list(self.running.items()):
            new = list(range(done, min(self.length, done + self.per_step)))
            self.running[rid] = done + len(new)
            finished = self.running[rid] == self.length
            if finished:
                del self.running[rid]
            outs.append(dataclasses.make_dataclass("Out", ["request_id", "new_token_ids", "finished"])(
                rid, new, finished))
        return outs


def test_speculative_benchmark_interleaves_both_engines_through_the_same_requests():
    """--interleave-ms: both engines run every request (refill: at most `batch` at once) in turns,
    each slice counted to its own engine, and a ratio recorded for each pair of slices."""
    from baton.benchmarks import speculative

    class Llm:
        def __init__(self, engine):
            self.engine = engine

        def generate(self, reqs, params):
            return []

    engines = {False: _CountingEngine(1), True: _CountingEngine(3)}
    reqs = [[i] for i in range(10)]
    tok_s, outs, ratios = speculative.run_interleaved({k: Llm(e) for k, e in engines.items()}, 4, reqs, None,
                                                       slice_ms=0.0, first=False)
    assert outs[False] == outs[True] == [list(range(7))] * 10
    assert engines[False].ids == engines[True].ids == 10 and not engines[False].running
    assert tok_s[False] > 0 and tok_s[True] > 0
    # a zero-length slice is one step: the pairs last while both run (the guessing engine's 9 steps)
    assert engines[True].steps == len(ratios) == 9 and engines[False].steps > 9


def test_served_speculative_rounds_opt_out_per_request_and_count_completion_tokens():
    """served_speculative's client: the edit requests to /chat/completions, `"speculative": false` only
    on the opted-out pass, completion tokens summed, answers in request order."""
    import http.server
    import threading

    from baton.benchmarks import served_speculative
    seen = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append(body)
            out = json.dumps({"usage": {"completion_tokens": 5},            # the answer: the request's start
                              "choices": [{"message": {"content": body["messages"][0]["content"][:80]}}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/v1"
        tok_s, texts = served_speculative.served_round(url, "m", 2, 4, 16, speculative=False)
        assert tok_s > 0 and texts == [served_speculative.ask(i)[:80] for i in range(4)] and len(seen) == 4
        assert all(b["speculative"] is False and b["max_tokens"] == 16 and b["temperature"] == 0 for b in seen)
        seen.clear()
        served_speculative.served_round(url, "m", 2, 4, 16, speculative=True)
        assert len(seen) == 4 and not any("speculative" in b for b in seen)
    finally:
        server.shutdown()


def test_percentile_interpolates_between_order_statistics_like_numpy():
    xs = [4.0, 1.0, 3.0, 2.0]
    assert percentile(xs, 0) == 1.0
    assert percentile(xs, 50) == 2.5
    assert percentile(xs, 90) == pytest.approx(3.7)
    assert percentile(xs, 100) == 4.0
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None
    with pytest.raises(ValueError):
        percentile(xs, 101)


def test_summary_of_an_empty_sample_is_all_none():
    assert summarize([]) == {"count": 0, "mean": None, "min": None, "p50": None, "p90": None, "p99": None,
                             "max": None}
    s = summarize([1, 2, 3])
    assert (s["count"], s["mean"], s["min"], s["p50"], s["max"]) == (3, 2, 1, 2, 3)


def test_tpot_is_the_time_after_the_first_token_over_the_remaining_tokens():
    assert tpot(e2e=1.0, ttft=0.2, output_tokens=5) == pytest.approx(0.2)
    assert tpot(e2e=1.0, ttft=0.2, output_tokens=1) is None       # no inter-token time exists


def test_a_request_meets_the_slos_only_if_it_succeeded_within_both():
    assert meets_slo(True, 0.5, 0.05, slo_ttft=1.0, slo_tpot=0.1)
    assert not meets_slo(True, 1.5, 0.05, slo_ttft=1.0, slo_tpot=0.1)
    assert not meets_slo(True, 0.5, 0.15, slo_ttft=1.0, slo_tpot=0.1)
    assert not meets_slo(False, 0.1, 0.01, slo_ttft=1.0, slo_tpot=0.1)     # failed requests always miss
    assert meets_slo(True, 0.5, None, slo_ttft=1.0, slo_tpot=0.1)         # one token: no TPOT to miss
    assert meets_slo(True, 9.0, 9.0, slo_ttft=None, slo_tpot=None)        # no SLO given: not checked
    assert attainment([True, False, True, True]) == 0.75
    assert attainment([]) is None


def test_goodput_is_the_highest_rate_with_at_least_90_percent_attainment():
    assert goodput_rate([(1, 1.0), (2, 0.95), (4, 0.85), (math.inf, 0.4)]) == 2
    assert goodput_rate([(1, 0.9), (2, 0.5)]) == 1                           # exactly 90 % passes
    assert goodput_rate([(1, 0.95), (2, 0.8), (4, 0.92)]) == 4              # the highest passing rate
    assert goodput_rate([(1, 0.95), (math.inf, 0.99)]) == math.inf
    assert goodput_rate([(1, 0.5), (2, None)]) is None


def test_histogram_quantile_interpolates_inside_the_bucket_as_prometheus_does():
    buckets = [(0.1, 2), (0.5, 6), (1.0, 10), (math.inf, 10)]
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.1 + 0.4 * 3 / 4)
    assert histogram_quantile(0.99, buckets) == pytest.approx(0.5 + 0.5 * 3.9 / 4)
    assert histogram_quantile(0.5, [(0.1, 0), (1.0, 0), (math.inf, 4)]) == 1.0     # beyond the last bound
    assert histogram_quantile(0.5, [(1.0, 0), (math.inf, 0)]) is None
    with pytest.raises(ValueError):
        histogram_quantile(0.5, [(1.0, 3)])


def test_handover_quantiles_come_from_the_histogram_delta_summed_over_workers():
    from prometheus_client import CollectorRegistry, Histogram
    regs = [CollectorRegistry(), CollectorRegistry()]
    hists = [Histogram("baton_handover_seconds", "h", buckets=(0.01, 0.1, 1.0), registry=r) for r in regs]
    hists[0].observe(5.0)                                       # before the sweep point: must not count
    before = _sum_parsed(regs)
    for v in (0.005, 0.05, 0.05):
        hists[0].observe(v)
    hists[1].observe(0.5)
    after = _sum_parsed(regs)
    q = prometheus.quantiles_between(before, after)
    assert q["count"] == 4
    assert q["p50"] == pytest.approx(0.01 + 0.09 * (2 - 1) / 2)      # rank 2 in the (0.01, 0.1] bucket
    assert q["p99"] == pytest.approx(0.1 + 0.9 * (3.96 - 3) / 1)
    assert prometheus.quantiles_between(after, after) == {"count": 0, "p50": None, "p99": None}
    assert prometheus.metrics_url("127.0.0.1:9100") == "http://127.0.0.1:9100/metrics"


def _sum_parsed(registries) -> dict:
    from prometheus_client import generate_latest
    total: dict = {}
    for r in registries:
        for le, n in prometheus.parse_histogram(generate_latest(r).decode(), "baton_handover_seconds").items():
            total[le] = total.get(le, 0) + n
    return total


# -- roofline --------------------------------------------------------------------------------------
TINY = ModelShape("tiny", "LlamaForCausalLM", layers=1, hidden=4, heads=2, kv_heads=1, head_dim=2, vocab=10,
                  intermediate=8, tie_word_embeddings=True)


def test_model_shape_counts_parameters_and_kv_bytes():
    # per layer: q 4x4 + k,v 2x(4x2) + o 4x4 + gate/up/down 3x(4x8) = 16 + 16 + 16 + 96
    assert TINY.layer_matmul_params == 144
    assert TINY.small_params == 2 * 4 + 4                      # two norms per layer + the final norm
    assert TINY.params == 144 + 12 + 40                        # tied: the 10x4 embedding counted once
    assert TINY.kv_bytes_per_token(2) == 2 * 1 * 1 * 2 * 2     # K and V x layers x kv heads x head_dim x bf16


@pytest.mark.parametrize("preset", ["qwen3-0.6b", "qwen3-8b", "llama-3.2-1b", "qwen2-0.5b", "qwen3-30b-a3b",
                                    "tiny-qwen3-moe", "minicpm4-0.5b"])
def test_model_shape_parameter_count_matches_the_checkpoint(preset):
    from baton.models import source as model_source
    from baton.models.loader import checkpoint_shapes
    cfg = model_source.resolve_model(preset).hf_config
    assert ModelShape.from_hf_config(preset, cfg).params == sum(math.prod(s) for _, s in checkpoint_shapes(cfg))


def test_roofline_of_hand_computed_steps():
    cost = CostModel(TINY, dtype_bytes=2)
    decode = StepShape([(3, 1), (5, 1)], sampled=2)
    chunk = StepShape([(0, 4)], sampled=0)                     # a prefill chunk that samples nothing
    # weights (144 + 12 + head 40) + 2 embedding rows of 4, in bf16; KV read 3 + 5 tokens, written 2; 8 B each
    assert cost.step_bytes(decode) == (144 + 12 + 40 + 2 * 4) * 2 + 8 * 8 + 2 * 8 == 488
    # 2 x 144 x 2 tokens + 2 x 40 x 2 rows + 4 x 1 layer x 2 heads x 2 dims x (4 + 6) query-key pairs
    assert cost.step_flops(decode) == 576 + 160 + 160 == 896
    # no head read (nothing samples); KV written for 4 tokens; causal pairs 1 + 2 + 3 + 4
    assert cost.step_bytes(chunk) == (144 + 12 + 4 * 4) * 2 + 4 * 8 == 376
    assert cost.step_flops(chunk) == 2 * 144 * 4 + 16 * 10 == 1312
    ceil = Ceilings(copy_bytes_per_s=200.0, matmul_flops_per_s=500.0)
    assert cost.least_seconds(decode, ceil) == (pytest.approx(2.44), "memory")
    assert cost.least_seconds(chunk, ceil) == (pytest.approx(2.624), "compute")
    r = roofline_report(cost, ceil, [decode, chunk], wall_seconds=10.0, step_seconds=[4.0, 6.0])
    assert r["least_seconds"] == pytest.approx(5.064)
    assert r["roofline_fraction"] == pytest.approx(0.5064)
    assert (r["memory_bound_steps"], r["compute_bound_steps"]) == (1, 1)
    assert r["by_kind"]["decode"]["roofline_fraction"] == pytest.approx(2.44 / 4.0)
    assert r["by_kind"]["prefill"]["roofline_fraction"] == pytest.approx(2.624 / 6.0)


def test_moe_roofline_reads_the_experts_hit_and_multiplies_the_active_ones():
    # TINY's attention (48) and one MoE layer of 4 experts, top 2, expert intermediate 2 (3x4x2 = 24)
    moe = dataclasses.replace(TINY, num_experts=4, experts_per_token=2, moe_intermediate=2, moe_layers=1)
    assert moe.shared_matmul_params == 48 + 4 * 4                 # attention + the 4x4 router
    assert moe.body_matmul_params == 64 + 4 * 24 and moe.active_matmul_params == 64 + 2 * 24
    assert moe.expected_experts_hit(1) == 2                       # one token: exactly its top 2
    assert moe.expected_experts_hit(2) == pytest.approx(4 * (1 - 0.5 ** 2))
    cost = CostModel(moe, dtype_bytes=2)
    decode = StepShape([(3, 1), (5, 1)], sampled=2)
    # shared 64 + 3 of 4 experts x 24 + norms 12 + head 40 + 2 embedding rows of 4; KV as for TINY
    assert cost.step_bytes(decode) == (64 + 72 + 12 + 40 + 8) * 2 + 8 * 8 + 2 * 8
    assert cost.step_flops(decode) == 2 * 112 * 2 + 160 + 160
    # --quantization fp8: the attention (48) and the 3 experts hit (72) in one byte each; the router and the rest not
    fp8 = CostModel(moe, dtype_bytes=2, fp8_weights=True, fp8_experts=True)
    assert fp8.step_bytes(decode) == (64 + 72 + 12 + 40 + 8 - 48 - 72) * 2 + 48 + 72 + 8 * 8 + 2 * 8
    r = roofline_report(cost, Ceilings(200.0, 500.0), [decode], wall_seconds=10.0)
    assert r["moe"]["experts_hit_at"][1] == 2 and "uniform routing" in r["moe"]["expert_bytes"]
    assert "moe" not in roofline_report(CostModel(TINY, 2), Ceilings(200.0, 500.0), [decode], 10.0)


def test_simulated_schedule_feeds_every_prompt_once_and_samples_every_output_token():
    prompts = [[1] * 40, [2] * 7, [3] * 100]
    outs = [5, 1, 12]
    steps = simulate_steps(prompts, outs, block_size=16, max_num_batched_tokens=64)
    assert sum(s.tokens for s in steps) == sum(len(p) + o - 1 for p, o in zip(prompts, outs, strict=True))
    assert sum(s.sampled for s in steps) == sum(outs)
    assert max(s.tokens for s in steps) <= 64
    assert steps[-1].is_decode


# -- workloads and load ----------------------------------------------------------------------------
def test_offline_workload_is_nano_vllms_draw_for_draw():
    from random import randint
    random.seed(0)                   # nano-vllm's bench.py, verbatim
    want_prompts = [[randint(0, 10000) for _ in range(randint(100, 1024))] for _ in range(256)]
    want_outs = [randint(100, 1024) for _ in range(256)]
    w = nano_vllm_workload()
    assert w.prompts == want_prompts
    assert w.output_lens == want_outs
    assert w.temperature == 0.6


def test_poisson_arrivals_have_the_requested_mean_rate_and_inf_sends_all_at_once():
    assert loadgen.arrival_times(5, math.inf, seed=0) == [0.0] * 5
    t = loadgen.arrival_times(4001, 10.0, seed=0)
    assert t[0] == 0.0 and t == sorted(t)
    assert t[-1] / 4000 == pytest.approx(0.1, rel=0.1)
    assert t == loadgen.arrival_times(4001, 10.0, seed=0)           # fixed seed, same schedule
    with pytest.raises(ValueError):
        loadgen.arrival_times(3, 0.0, seed=0)


def test_long_prompt_datasets_are_exact_lengths_and_128k_needs_its_context():
    for name, tokens in (("long-8k", 8192), ("long-32k", 32768), ("long-128k", 131064)):
        inp, out = datasets.LENGTHS[name]
        [r] = datasets.build_requests(name, 1, seed=0, input_len=inp, output_len=out, max_model_len=131072,
                                      vocab_size=151936)
        assert len(r.prompt_ids) == tokens and r.max_tokens == 8 and len(r.prompt_ids) + r.max_tokens <= 131072
    with pytest.raises(ValueError, match="does not fit max_model_len 40960"):         # qwen3-8b without YaRN
        datasets.build_requests("long-128k", 1, 0, *datasets.LENGTHS["long-128k"], max_model_len=40960,
                                vocab_size=151936)


def test_a_salted_pass_keeps_every_length_and_group_with_other_token_ids():
    for name in ("random", "shared-prefix", "mixed"):
        args = dict(input_len=(4, 300), output_len=(2, 30), max_model_len=2048, vocab_size=49152, prefix_len=20,
                    group_size=3)
        first, again, salted = (datasets.build_requests(name, 9, seed=7, salt=salt, **args) for salt in (0, 0, 1))
        assert [r.prompt_ids for r in first] == [r.prompt_ids for r in again]          # salt 0: as before
        assert [(len(r.prompt_ids), r.max_tokens, r.group) for r in first] == \
            [(len(r.prompt_ids), r.max_tokens, r.group) for r in salted]
        assert all(a.prompt_ids[:4] != b.prompt_ids[:4] for a, b in zip(first, salted, strict=True))
        if name == "shared-prefix":                        # groups still share their (new) system prompt
            assert salted[0].prompt_ids[:20] == salted[2].prompt_ids[:20] != first[0].prompt_ids[:20]


def test_shared_prefix_requests_share_their_groups_system_prompt(tmp_path):
    reqs = datasets.build_requests("shared-prefix", 6, seed=1, input_len=(4, 8), output_len=(2, 3),
                                   max_model_len=2048, vocab_size=49152, prefix_len=20, group_size=3)
    assert [r.group for r in reqs] == [0, 0, 0, 1, 1, 1]
    assert reqs[0].prompt_ids[:20] == reqs[2].prompt_ids[:20] != reqs[3].prompt_ids[:20]
    assert all(24 <= len(r.prompt_ids) <= 28 and 2 <= r.max_tokens <= 3 for r in reqs)
    f = tmp_path / "set.jsonl"
    f.write_text('{"prompt": "hi", "max_tokens": 4}\n\n{"prompt": "yo", "max_tokens": 2}\n')
    rows = datasets.build_requests(str(f), 3, 0, (1, 1), (1, 1), 2048, 49152)
    assert [(r.text, r.max_tokens) for r in rows] == [("hi", 4), ("yo", 2), ("hi", 4)]
    with pytest.raises(ValueError, match="does not fit"):
        datasets.build_requests("random", 1, 0, (100, 200), (50, 60), max_model_len=120, vocab_size=100)
    assert datasets.parse_range("8:32") == (8, 32) and datasets.parse_range("5") == (5, 5)
    assert parse_rates("1,2.5,inf") == [1.0, 2.5, math.inf]
    with pytest.raises(ValueError):
        parse_rates("1,-2")


def test_rate_summary_counts_errors_throughput_and_slo_attainment():
    ok = [loadgen.RequestResult(i, 0.0, ttft=0.1 * (i + 1), e2e=0.1 * (i + 1) + 0.4, output_tokens=5,
                                prompt_tokens=10, cached_tokens=2, itls=[0.1] * 4) for i in range(3)]
    failed = loadgen.RequestResult(3, 0.0, status="UNAVAILABLE", error="no decode worker", e2e=0.01)
    p = summarize_rate(2.0, ok + [failed], wall=2.0, slo_ttft_s=0.25, slo_tpot_s=0.11)
    assert (p["num_requests"], p["completed"], p["errors"]) == (4, 3, {"UNAVAILABLE": 1})
    assert p["request_throughput"] == 1.5 and p["output_throughput"] == 7.5
    assert (p["prompt_tokens"], p["output_tokens"], p["cached_tokens"]) == (30, 15, 6)
    assert p["tpot_s"]["p50"] == pytest.approx(0.1)                        # (E2E - TTFT) / (5 - 1)
    assert p["itl_s"]["count"] == 12
    assert p["ttft_s"]["p50"] == pytest.approx(0.2)
    assert (p["slo_met"], p["slo_attainment"]) == (2, 0.5)                # TTFT 0.3 misses; failure misses
    assert p["goodput_req_s"] == 1.0


def test_kv_payload_is_layers_times_k_and_v_times_heads_times_head_dim_in_whole_blocks():
    from baton.models import source as model_source
    qwen = ModelShape.from_hf_config("qwen3-0.6b", model_source.resolve_model("qwen3-0.6b").hf_config)
    assert payload_bytes(qwen, 512, "bfloat16", 16) == (512 * 28 * 2 * 8 * 128 * 2, 512)
    assert payload_bytes(qwen, 500, "float32", 16) == (512 * 28 * 2 * 8 * 128 * 4, 512)


def test_json_records_write_infinite_rates_as_strings(tmp_path):
    rec = record.new_record("serve", ["serve", "--smoke"], True, {"rates": [1.0, math.inf]})
    path = record.write(rec, tmp_path / "r.json")
    data = json.loads(path.read_text())
    assert data["config"]["rates"] == [1.0, "inf"]
    assert data["command_line"] == "baton bench serve --smoke" and data["finished_at"]


# -- smoke runs, end to end on the CPU ------------------------------------------------------------------
def _bench(tmp_path, *args: str, timeout: int = 240) -> dict:
    out = tmp_path / f"{args[0]}.json"
    r = subprocess.run([*BENCH, *args, "--output", str(out)], cwd=REPO, capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0, r.stderr[-4000:]
    data = json.loads(out.read_text())
    for key in ("schema", "command_line", "git", "versions", "model", "dtype", "device", "ceilings", "results"):
        assert data[key] is not None, key
    assert data["ceilings"]["copy"]["bytes_per_s"] > 0 and data["ceilings"]["matmul"]["flops_per_s"] > 0
    return data


def test_offline_smoke_runs_the_workload_and_accounts_for_every_token(tmp_path):
    data = _bench(tmp_path, "offline", "--smoke")
    r, w = data["results"], data["results"]["workload"]
    assert data["model"]["name"] == "smollm2-135m-instruct" and data["model"]["params"] > 1e8
    assert r["output_tokens"] == w["requested_output_tokens"]             # ignore_eos: exact lengths
    # every prompt token fed once, every output token but the last fed back once
    assert r["steps"]["scheduled_tokens"] == w["prompt_tokens"] + w["requested_output_tokens"] - w["num_seqs"]
    assert r["steps"]["sampled_rows"] == w["requested_output_tokens"]
    assert r["steps"]["decode_seconds"]["count"] > 0
    assert 0 < r["roofline"]["roofline_fraction"]
    assert r["roofline"]["steps"] == r["steps"]["count"]


def test_offline_smoke_through_transformers_generates_the_same_token_count(tmp_path):
    data = _bench(tmp_path, "offline", "--smoke", "--engine", "transformers", "--model", "tiny-llama",
                  "--num-seqs", "4")
    r = data["results"]
    assert r["engine"] == "transformers" and r["hf_mode"] == "continuous"
    assert r["output_tokens"] == r["workload"]["requested_output_tokens"]
    assert r["roofline"]["roofline_fraction"] > 0


def test_the_transformers_peer_of_a_moe_preset_holds_batons_weights():
    """transformers 5 stacks a MoE layer's experts where the synthesised checkpoint names each
    expert: the peer routes them into its stacked parameters, so both engines hold one model."""
    from helpers import hf_greedy

    from baton.benchmarks.offline_transformers import load_hf_model
    from baton.engine import LLM, SamplingParams
    hf = load_hf_model("tiny-qwen3-moe", "cpu", "float32")
    llm = LLM("tiny-qwen3-moe", dtype="float32", num_kv_blocks=32)
    prompt = [5, 900, 31, 77, 1024, 3]
    ours = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].token_ids
    assert ours == hf_greedy(hf, [prompt], 8)[0]


def test_kv_smoke_measures_grpc_direct_and_nixl_against_their_references(tmp_path):
    data = _bench(tmp_path, "kv", "--smoke", "--tokens", "20", "--backends", "grpc,direct,nixl")   # each spawns processes
    rows = data["results"]["transfers"]
    assert [(t["backend"], t["tokens"], t["tokens_in_blocks"]) for t in rows] == [
        ("grpc", 20, 32), ("direct", 20, 32), ("nixl", 20, 32)]
    per_token = data["results"]["kv_bytes_per_token"]
    assert per_token == 30 * 2 * 3 * 64 * 2                   # SmolLM2-135M, bf16
    for t in rows:
        assert t["bytes"] == t["tokens_in_blocks"] * per_token
        lat = t["latency_s"]
        assert lat["p50"] > 0 and t["reference"]["bandwidth_bytes_per_s"] > 0
        assert lat["p99"] is None or lat["best"] <= lat["p50"] <= lat["p99"]
        assert t["fraction_of_reference"] == pytest.approx(t["bandwidth_bytes_per_s"]
                                                           / t["reference"]["bandwidth_bytes_per_s"])
    direct = rows[1]                 # gloo between two processes on the CPU, as between two workers
    assert direct["backend_config"]["collective"] == "gloo" and direct["backend_config"]["processes"] == 2
    assert len(direct["latency_s"]["samples"]) == len(direct["from_ready"]["latency_s"]["samples"]) == 3
    assert 0 < direct["from_ready"]["latency_s"]["p50"] and direct["pipelined"]["transfers_in_flight"] >= 2
    assert direct["pipelined"]["fraction_of_reference"] == pytest.approx(
        direct["pipelined"]["bytes_per_s"] / direct["reference"]["bandwidth_bytes_per_s"])
    steady = direct["sustained"]
    assert steady["transfers"] > steady["window"] >= 2 and steady["fraction_of_reference"] == pytest.approx(
        steady["bytes_per_s"] / direct["reference"]["bandwidth_bytes_per_s"])
    nixl = rows[2]                   # NIXL over UCX between two processes, measured as direct is,
    assert nixl["backend_config"]["processes"] == 2 and nixl["sustained"]["bytes_per_s"] > 0
    # ... written straight into the receiver's KV cache pages
    assert nixl["backend_config"]["landed_in_place"] > 0 == direct["backend_config"]["landed_in_place"]


def test_serve_smoke_launches_1p1d_and_reports_every_request(tmp_path):
    """The same load through the gRPC API and through the router's OpenAI API, served by two router
    processes sharing the ports (--routers 2): the router's stage figures add up over both."""
    data = _bench(tmp_path, "serve", "--smoke", "--api", "grpc,openai", "--routers", "2", timeout=400)
    topos = data["results"]["topologies"]
    assert set(topos) == {"1p1d@grpc", "1p1d@openai"}
    lengths = {api: [r["output_tokens"] for p in topos[f"1p1d@{api}"]["rates"] for r in p["requests"]]
               for api in ("grpc", "openai")}
    assert lengths["grpc"] == lengths["openai"], lengths              # the same lengths, request for request
    # ... but other token ids: the second pass finds nothing of the first's in the prefix caches (full blocks of
    # 16 tokens: some prompts have one)
    second = [r for p in topos["1p1d@openai"]["rates"] for r in p["requests"]]
    assert max(r["prompt_tokens"] for r in second) > 16 and all(r["cached_tokens"] == 0 for r in second), second
    assert topos["1p1d@openai"]["deployment"]["api"] == "openai"
    topo = topos["1p1d@grpc"]
    assert [p["request_rate"] for p in topo["rates"]] == [4.0, "inf"]
    for p in [*topo["rates"], *topos["1p1d@openai"]["rates"]]:
        assert p["completed"] == p["num_requests"] == 3 and p["errors"] == {}
        for req in p["requests"]:
            assert req["status"] == "OK" and req["finish_reason"] == "length"
            assert req["output_tokens"] >= 1 and len(req["itls"]) <= req["output_tokens"] - 1
            assert req["ttft"] <= req["e2e"]
        assert p["handover_s"]["count"] == 3                   # one handover per request, from decode metrics
        stages = p["stages_s"]                                  # the router's, for the requests of this rate
        assert set(stages) == {"queue", "admit", "prefill", "handover", "decode"} and \
            all(s["count"] == 3 for s in stages.values())
        mean_e2e = sum(r["e2e"] for r in p["requests"]) / 3
        assert sum(s["mean_s"] for s in stages.values()) == pytest.approx(mean_e2e, rel=0.25)   # its clock, ours
        assert 0 <= p["slo_attainment"] <= 1
    assert {w["role"] for w in topo["deployment"]["workers"]} == {"prefill", "decode"}
    assert topo["deployment"]["routers"] == 2
    assert all(path.endswith(".png") for path in data["results"]["plots"])


def test_multiturn_smoke_with_pd_reuse_sends_only_the_blocks_decode_lacks(tmp_path):
    """`bench multiturn --compare-pd-reuse`: the same conversations through 1P1D with the decode
    side's reuse off, then on. Off: every turn's whole prompt KV is sent, none reused. On: the later
    turns find their history on the decode side, and the bytes fall by exactly the reused blocks."""
    out = tmp_path / "multiturn.json"
    r = subprocess.run([*BENCH, "multiturn", "--smoke", "--compare-pd-reuse", "--output", str(out)], cwd=REPO,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    data = json.loads(out.read_text())
    off, on = data["results"]["reuse off"], data["results"]["reuse on"]
    assert [t["prompt_tokens"] for t in off["turns"]] == [t["prompt_tokens"] for t in on["turns"]]   # same chats
    assert all(t["status"] == "OK" and t["ttft"] is not None for t in off["turns"] + on["turns"])
    block = 16
    blocks = sum(math.ceil(t["prompt_tokens"] / block) for t in off["turns"])
    block_bytes = off["kv_bytes_sent"] / blocks
    assert off["reused_tokens"] == 0 and block_bytes == int(block_bytes) > 0       # whole blocks, every prompt
    assert on["reused_tokens"] > 0 and on["reused_tokens"] % block == 0
    assert on["kv_bytes_sent"] == off["kv_bytes_sent"] - on["reused_tokens"] // block * block_bytes
    assert data["reuse_over_no_reuse"]["bytes_fall"] == pytest.approx(on["reused_tokens"] // block / blocks)


def test_multiturn_smoke_compares_routing_policies_against_the_oracle(tmp_path):
    """`bench multiturn --compare-policies`: the conversations through two colocated workers, once
    per policy (one here: each costs a stack). kv_aware sends a returning conversation where its
    history is (>= 90 % of the oracle's cached tokens); the oracle is every full block of the
    history; with targets every turn meets, goodput is every turn over the wall time. (That it
    beats the others is tests/test_kv_events.py's and the GPU figure's business.)"""
    out = tmp_path / "multiturn.json"
    r = subprocess.run([*BENCH, "multiturn", "--smoke", "--compare-policies", "--policies", "kv_aware",
                        "--slo-ttft-ms", "60000", "--slo-tpot-ms", "10000", "--output", str(out)], cwd=REPO,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    data = json.loads(out.read_text())
    assert list(data["results"]) == ["kv_aware"] and data["workload"]["devices"] == ["cpu", "cpu"]
    kv = data["results"]["kv_aware"]
    assert len(kv["turns"]) == data["workload"]["users"] * data["workload"]["turns"]
    for t in kv["turns"]:
        assert t["status"] == "OK" and t["tpot"] is not None and 0 <= t["cached_tokens"] <= t["prompt_tokens"]
        history = t["prompt_tokens"] - data["workload"]["message_len"]
        assert t["oracle_cached_tokens"] == ((history - 1) // 16 * 16 if t["turn"] else 0)
    assert kv["share_of_oracle"] >= 0.9
    assert kv["slo_attained"] == 1 and kv["goodput_turns_s"] == pytest.approx(len(kv["turns"]) / kv["wall_s"])
