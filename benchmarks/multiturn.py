"""`baton bench multiturn`: multi-turn chat. --users conversations at once, each --turns turns:
a turn's prompt is the whole conversation so far (its system prompt, every earlier message and
answer) plus a new message, sent after a think time (exponential, mean --think-s) once the last
answer ended. What a prefix cache is for: every turn after the first could find all but its new
message cached. Reported: TTFT of the later turns (p50 / p90), output tokens per second over the
run, and the share of prompt tokens found cached, per deployment.

--compare-offload launches one colocated worker on --device twice, its device KV cache sized so
the conversations' working set is --working-set-x times it (--num-kv-blocks), first without and
then with the prefix cache's host tier (--kv-offloading-size --offload-gib), and runs the same
conversations (same seed) against each: the host tier's figure, same device, same run. Without
it, the conversations run against --addr.

--compare-pd-reuse launches one prefill and one decode worker (--devices, --kv-backend) twice, first
with the decode side's prefix reuse off (--no-decode-prefix-reuse: every turn's whole prompt KV is
sent) and then on (the decode worker keeps its own prefix cache; the prefill worker sends only the
blocks it lacks), and runs the same conversations against each. Beside TTFT it reports the KV bytes
the prefill worker sent and the prompt tokens the decode side reused (the workers' metrics): the bytes
should fall by the reused fraction.

--compare-policies launches one colocated worker per --devices entry behind a router, once per routing
policy in --policies, and runs the same conversations against each: where each policy sends a returning
conversation decides whether its history is found cached. Beside TTFT it reports the share of prompt
tokens found cached against an oracle's (a router that always sends a conversation back to the worker
that served its last turn, on workers that never evict: all of the history's full blocks cached) and
goodput: turns a second that met both --slo-ttft-ms and --slo-tpot-ms (errors count as misses).
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import math
import random
import statistics
import time
from pathlib import Path

import grpc

from baton.benchmarks import deployment, loadgen, prometheus, record
from baton.benchmarks.datasets import MAX_TOKEN_ID
from baton.benchmarks.loadgen import CHANNEL_OPTIONS
from baton.engine.config import DEFAULT_MODEL
from baton.v1 import router_pb2, router_pb2_grpc

FULL = dict(users=32, turns=6, system_len=1024, message_len=128, output_len=128, think_s=1.0, device="cuda:0",
            devices="cuda:0,cuda:1")
SMOKE = dict(users=4, turns=3, system_len=48, message_len=8, output_len=8, think_s=0.05, device="cpu",
             devices="cpu,cpu")
FLEET_DEVICES = {"full": "cuda:0,cuda:1,cuda:2,cuda:3", "smoke": "cpu,cpu"}
POLICIES = "least_loaded,prefix_aware,kv_aware"
BLOCK_SIZE = 16


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--addr", default="127.0.0.1:50051", help="the router (without --compare-offload)")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--device", default=None, help=f"--compare-offload's device (default: {FULL['device']})")
    for name, kind in (("users", int), ("turns", int), ("system-len", int), ("message-len", int),
                       ("output-len", int), ("think-s", float)):
        p.add_argument(f"--{name}", type=kind, default=None, help=f"(default: {FULL[name.replace('-', '_')]})")
    p.add_argument("--shared-len", type=int, default=0,
                   help="the system prompt's first tokens every conversation shares (an app's common instructions)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compare-offload", action="store_true",
                   help="launch one colocated worker without, then with the host tier, and compare")
    p.add_argument("--working-set-x", type=float, default=3.0, help="the conversations' KV over the device cache's")
    p.add_argument("--offload-gib", type=float, default=16.0, help="the host tier's size (--kv-offloading-size)")
    p.add_argument("--compare-pd-reuse", action="store_true",
                   help="launch 1P1D with the decode side's prefix reuse off, then on, and compare")
    p.add_argument("--devices", default=None, help=f"--compare-pd-reuse's prefill,decode devices (default: "
                                                   f"{FULL['devices']}); --compare-policies' workers' devices, "
                                                   f"one worker each (default: {FLEET_DEVICES['full']})")
    p.add_argument("--compare-policies", action="store_true",
                   help="launch one colocated worker per --devices entry behind a router once per --policies "
                        "entry, and compare the routing policies")
    p.add_argument("--policies", default=POLICIES, help="--compare-policies' router policies, in order")
    p.add_argument("--topology", default=None,
                   help="--compare-policies' deployment, e.g. 1p2d or 2p2d, its workers placed on --devices in "
                        "order (default: one colocated worker per --devices entry); a PD one also reports the "
                        "decode workers' own reuse against the oracle's")
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0, help="a turn's TTFT target, for goodput")
    p.add_argument("--slo-tpot-ms", type=float, default=50.0, help="a turn's TPOT target, for goodput")
    p.add_argument("--kv-backend", default=None, help="--compare-pd-reuse's KV backend (default: the workers')")
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help="--compare-pd-reuse: each worker's device KV blocks (default: sized from free memory)")
    p.add_argument("--worker-args", default="", help="more flags for the launched worker")
    p.add_argument("--log-dir", default=None)


def resolve(args: argparse.Namespace) -> None:
    base = SMOKE if args.smoke else FULL
    if getattr(args, "compare_policies", False) and args.devices is None:
        args.devices = FLEET_DEVICES["smoke" if args.smoke else "full"]
    for key, value in base.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if args.users < 1 or args.turns < 2:
        raise ValueError("--users must be >= 1 and --turns >= 2 (the first turn finds nothing cached)")
    if not 0 <= args.shared_len <= args.system_len:
        raise ValueError(f"--shared-len must be within 0..--system-len ({args.system_len}), got {args.shared_len}")


def working_set_tokens(args: argparse.Namespace) -> int:
    return args.users * (args.system_len + args.turns * (args.message_len + args.output_len))


def device_blocks(args: argparse.Namespace) -> int:
    """A device KV cache the conversations' working set is --working-set-x times, yet one that holds
    the longest conversation's last turn."""
    longest = args.system_len + args.turns * (args.message_len + args.output_len)
    need = math.ceil(working_set_tokens(args) / args.working_set_x / BLOCK_SIZE)
    return max(need, 2 * math.ceil(longest / BLOCK_SIZE))


def shared_prefix(args: argparse.Namespace) -> list[int]:
    rng = random.Random(f"shared-{args.seed}")
    return [rng.randrange(1, MAX_TOKEN_ID) for _ in range(args.shared_len)]


async def converse(stub, rng: random.Random, args: argparse.Namespace, user: int, t_zero: float) -> list[dict]:
    history = shared_prefix(args) + [rng.randrange(1, MAX_TOKEN_ID) for _ in range(args.system_len - args.shared_len)]
    turns = []
    for turn in range(args.turns):
        await asyncio.sleep(rng.expovariate(1 / args.think_s) if args.think_s > 0 else 0)
        prompt = history + [rng.randrange(1, MAX_TOKEN_ID) for _ in range(args.message_len)]
        req = router_pb2.GenerateRequest(tokens=router_pb2.TokenIds(ids=prompt), sampling=router_pb2.SamplingParams(
            temperature=0, max_tokens=args.output_len, ignore_eos=True))
        start, ttft, out, cached, status = time.perf_counter(), None, [], 0, "OK"
        try:
            async for resp in stub.Generate(req, timeout=600):
                if resp.token_ids and ttft is None:
                    ttft = time.perf_counter() - start
                out += resp.token_ids
                if resp.HasField("usage"):
                    cached = resp.usage.cached_prompt_tokens
        except grpc.aio.AioRpcError as exc:
            status = exc.code().name
        e2e = time.perf_counter() - start
        # a sticky router on workers that never evict: every full block of the history (the last
        # answer's final token has no KV yet) is cached
        oracle = (len(history) - 1) // BLOCK_SIZE * BLOCK_SIZE if turn else 0
        turns.append({"user": user, "turn": turn, "sent_at": start - t_zero, "prompt_tokens": len(prompt),
                      "output_tokens": len(out), "cached_tokens": cached, "oracle_cached_tokens": oracle,
                      "ttft": ttft, "e2e": e2e, "status": status,
                      "tpot": (e2e - ttft) / (len(out) - 1) if ttft is not None and len(out) > 1 else None})
        if status != "OK":
            break
        history = prompt + out
    return turns


async def drive(address: str, args: argparse.Namespace) -> dict:
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as ch:
        stub = router_pb2_grpc.RouterStub(ch)
        t_zero = time.perf_counter()
        runs = await asyncio.gather(*(converse(stub, random.Random(args.seed * 1000 + u), args, u, t_zero)
                                      for u in range(args.users)))
        wall = time.perf_counter() - t_zero
    turns = [t for run in runs for t in run]
    later = sorted(t["ttft"] for t in turns if t["turn"] > 0 and t["ttft"] is not None)
    ok = [t for t in turns if t["status"] == "OK"]
    prompt_tokens = max(1, sum(t["prompt_tokens"] for t in ok))
    good = [t for t in ok if t["ttft"] is not None and t["ttft"] * 1e3 <= args.slo_ttft_ms
            and (t["tpot"] is None or t["tpot"] * 1e3 <= args.slo_tpot_ms)]
    return {"wall_s": wall, "turns": turns, "errors": len(turns) - len(ok),
            "goodput_turns_s": len(good) / wall, "slo_attained": len(good) / max(1, len(turns)),
            "oracle_share": sum(t["oracle_cached_tokens"] for t in ok) / prompt_tokens,
            "ttft_p50_s": statistics.median(later) if later else None,
            "ttft_p90_s": later[int(0.9 * (len(later) - 1))] if later else None,
            "output_tok_s": sum(t["output_tokens"] for t in ok) / wall,
            "cached_share": sum(t["cached_tokens"] for t in ok) / prompt_tokens}


def run(args: argparse.Namespace, rec: dict) -> None:
    rec["workload"] = {"users": args.users, "turns": args.turns, "system_len": args.system_len,
                       "shared_len": args.shared_len,
                       "message_len": args.message_len, "output_len": args.output_len, "think_s": args.think_s,
                       "working_set_tokens": working_set_tokens(args)}
    if sum((args.compare_offload, args.compare_pd_reuse, args.compare_policies)) > 1:
        raise ValueError("--compare-offload, --compare-pd-reuse and --compare-policies each launch their own "
                         "deployments: pick one")
    rec["workload"] |= {"slo_ttft_ms": args.slo_ttft_ms, "slo_tpot_ms": args.slo_tpot_ms}
    if args.compare_pd_reuse:
        return compare_pd_reuse(args, rec)
    if args.compare_policies:
        return compare_policies(args, rec)
    if not args.compare_offload:
        asyncio.run(loadgen.model_info(args.addr))          # a RuntimeError when no router answers there
        rec["results"] = {"external": asyncio.run(drive(args.addr, args))}
        _print("external", rec["results"]["external"])
        return
    blocks = device_blocks(args)
    rec["device"] = record.device_info([args.device])
    rec["workload"] |= {"device_kv_blocks": blocks, "working_set_x": working_set_tokens(args) / (blocks * BLOCK_SIZE),
                        "offload_gib": args.offload_gib}
    rec["results"] = {}
    log_root = _log_root(args)
    for name, extra in (("device only", []), ("host tier", ["--kv-offloading-size", str(args.offload_gib)])):
        worker_args = ["--num-kv-blocks", str(blocks), "--block-size", str(BLOCK_SIZE), *args.worker_args.split(),
                       *extra]
        dep = deployment.launch("1colocated", args.model, [args.device], worker_args, log_root / name.replace(" ", "-"))
        try:
            rec["results"][name] = asyncio.run(drive(dep.router_address, args))
        finally:
            dep.stop()
        _print(name, rec["results"][name])
    a, b = rec["results"]["device only"], rec["results"]["host tier"]
    if a["ttft_p50_s"] and b["ttft_p50_s"]:
        rec["host_tier_over_device"] = {"ttft_p50": a["ttft_p50_s"] / b["ttft_p50_s"],
                                        "output_tok_s": b["output_tok_s"] / a["output_tok_s"]}
        print(f"[bench] host tier vs device only: TTFT p50 {rec['host_tier_over_device']['ttft_p50']:.2f}x lower, "
              f"throughput {rec['host_tier_over_device']['output_tok_s']:.2f}x", flush=True)


def _log_root(args: argparse.Namespace) -> Path:
    return Path(args.log_dir) if args.log_dir else Path(args.output).with_suffix("").with_name(
        Path(args.output).stem + "-logs")


KV_BYTES, REUSED = "baton_kv_transfer_bytes_total", "baton_pd_reused_tokens_total"


def _counters(dep: deployment.Deployment) -> dict[str, float]:
    """KV bytes the prefill worker sent and prompt tokens the decode worker reused, as of now."""
    out = {"kv_bytes_sent": 0.0, "reused_tokens": 0.0}
    for w in dep.workers:
        if w["role"] == "prefill":
            out["kv_bytes_sent"] += prometheus.counter_sum(w["metrics_url"], KV_BYTES, direction="out")
        else:
            out["reused_tokens"] += prometheus.counter_sum(w["metrics_url"], REUSED)
    return out


def compare_pd_reuse(args: argparse.Namespace, rec: dict) -> None:
    """The same conversations through 1P1D with the decode side's prefix reuse off, then on."""
    devices = args.devices.split(",")
    if len(devices) != 2:
        raise ValueError(f"--devices wants two devices (prefill,decode), got {args.devices!r}")
    rec["device"] = record.device_info(devices)
    rec["workload"] |= {"devices": devices, "kv_backend": args.kv_backend or "default"}
    rec["results"] = {}
    common = ["--block-size", str(BLOCK_SIZE), *args.worker_args.split()]
    common += ["--num-kv-blocks", str(args.num_kv_blocks)] if args.num_kv_blocks else []
    common += ["--kv-backend", args.kv_backend] if args.kv_backend else []
    for name, switch in (("reuse off", "--no-decode-prefix-reuse"), ("reuse on", "--decode-prefix-reuse")):
        dep = deployment.launch("1p1d", args.model, devices, [*common, switch], _log_root(args) / name.replace(" ", "-"))
        try:
            before = prometheus.settled(functools.partial(_counters, dep))
            result = asyncio.run(drive(dep.router_address, args))
            after = prometheus.settled(functools.partial(_counters, dep))
        finally:
            dep.stop()
        result |= {key: after[key] - before[key] for key in after}
        prompt = sum(t["prompt_tokens"] for t in result["turns"] if t["status"] == "OK")
        result["reused_share"] = result["reused_tokens"] / max(1, prompt)
        rec["results"][name] = result
        _print(name, result)
        print(f"[bench] {name}: {result['kv_bytes_sent'] / 2**20:.0f} MiB of KV sent, "
              f"{100 * result['reused_share']:.0f} % of prompt tokens reused on the decode side", flush=True)
    off, on = rec["results"]["reuse off"], rec["results"]["reuse on"]
    if off["kv_bytes_sent"] and off["ttft_p50_s"] and on["ttft_p50_s"]:
        rec["reuse_over_no_reuse"] = {
            "ttft_p50": off["ttft_p50_s"] / on["ttft_p50_s"],
            "output_tok_s": on["output_tok_s"] / off["output_tok_s"],
            "bytes_fall": 1 - on["kv_bytes_sent"] / off["kv_bytes_sent"],
            "reused_share": on["reused_share"]}
        r = rec["reuse_over_no_reuse"]
        print(f"[bench] decode-side reuse vs none: TTFT p50 {r['ttft_p50']:.2f}x lower, throughput "
              f"{r['output_tok_s']:.2f}x, KV bytes {100 * r['bytes_fall']:.0f} % fewer for "
              f"{100 * r['reused_share']:.0f} % of prompt tokens reused", flush=True)


def compare_policies(args: argparse.Namespace, rec: dict) -> None:
    """The same conversations through N colocated workers (or --topology's xPyD), once per routing
    policy. In PD `share_of_oracle` is the prefill workers' prefix cache and `decode_share_of_oracle`
    the decode workers' own (--decode-prefix-reuse: the blocks the prefill worker did not send)."""
    devices = [d.strip() for d in args.devices.split(",") if d.strip()]
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    topology = args.topology or f"{len(devices)}colocated"
    pd = not deployment.parse(topology).colocated
    if len(devices) < 2 or not policies:       # (an unknown policy: the router refuses it at start-up)
        raise ValueError(f"--compare-policies wants two or more --devices and one or more --policies; got "
                         f"{args.devices!r} and {args.policies!r}")
    rec["device"] = record.device_info(devices)
    rec["workload"] |= {"devices": devices, "policies": policies, "topology": topology}
    rec["results"] = {}
    worker_args = ["--block-size", str(BLOCK_SIZE), *args.worker_args.split()]
    worker_args += ["--num-kv-blocks", str(args.num_kv_blocks)] if args.num_kv_blocks else []
    for policy in policies:
        dep = deployment.launch(topology, args.model, devices, worker_args, _log_root(args) / policy,
                                router_args=["--policy", policy])
        try:
            before = prometheus.settled(functools.partial(_counters, dep)) if pd else {}
            result = asyncio.run(drive(dep.router_address, args))
            after = prometheus.settled(functools.partial(_counters, dep)) if pd else {}
        finally:
            dep.stop()
        result |= {key: after[key] - before[key] for key in after}
        result["share_of_oracle"] = result["cached_share"] / result["oracle_share"] if result["oracle_share"] else None
        if pd:
            oracle = sum(t["oracle_cached_tokens"] for t in result["turns"] if t["status"] == "OK")
            result["decode_share_of_oracle"] = result["reused_tokens"] / oracle if oracle else None
        rec["results"][policy] = result
        _print(policy, result)
        where = (f"{100 * (result['share_of_oracle'] or 0):.0f} % of the oracle's cached tokens on the prefill "
                 f"side, {100 * (result['decode_share_of_oracle'] or 0):.0f} % on the decode side "
                 f"({result['kv_bytes_sent'] / 2**20:.1f} MiB of KV sent)" if pd else
                 f"{100 * (result['share_of_oracle'] or 0):.0f} % of the oracle's cached tokens")
        print(f"[bench] {policy}: {where}, goodput {result['goodput_turns_s']:.2f} turns/s "
              f"({100 * result['slo_attained']:.0f} % of turns met TTFT <= {args.slo_ttft_ms:g} ms and TPOT <= "
              f"{args.slo_tpot_ms:g} ms)", flush=True)


def _ms(s: float | None) -> str:
    return f"{s * 1e3:.0f} ms" if s is not None else "-"


def _print(name: str, r: dict) -> None:
    print(f"[bench] {name}: TTFT p50 {_ms(r['ttft_p50_s'])} p90 {_ms(r['ttft_p90_s'])}, {r['output_tok_s']:.0f} "
          f"output tok/s, {100 * r['cached_share']:.0f} % of prompt tokens cached, {r['errors']} error(s), "
          f"{r['wall_s']:.1f} s", flush=True)
