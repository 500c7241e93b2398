"""B1's peer: the same workload, weights and device through Hugging Face transformers' own
batched generation — what a user would reach for instead of Baton.

`continuous`: transformers' continuous batching with paged attention (the manager behind
`model.generate_batch`, driven directly so every request keeps its own output length).
`static`: padded `model.generate` in chunks of --hf-batch-size, each chunk generating to
its longest output (the waste is the price of static batching and is counted as such).
"""
from __future__ import annotations

import argparse
import math
import re
import sys
import time

import torch

from baton.benchmarks.workload import OfflineWorkload, warmup_workload

RESULT_TIMEOUT_S = 600.0
NO_TRANSFORMERS_CLASS = ("MiniCPMForCausalLM",)


def load_hf_model(model: str, device: str, dtype: str):
    """The transformers model holding exactly the weights Baton's engine would load."""
    from transformers import AutoModelForCausalLM

    from baton.models import loader
    from baton.models import source as model_source
    source = model_source.resolve_model(model)
    if source.architecture in NO_TRANSFORMERS_CLASS:
        raise ValueError(f"--engine transformers: transformers has no class for {source.architecture} (its "
                         "checkpoints ship remote code, which Baton does not run); bench it with Baton only")
    torch_dtype = getattr(torch, dtype)
    if source.weights_path is not None:
        hf = AutoModelForCausalLM.from_pretrained(source.weights_path, dtype=torch_dtype).to(device)
    else:                       # a preset: the same deterministic random weights, same recipe and seed
        with torch.device(device):
            hf = AutoModelForCausalLM.from_config(source.hf_config, dtype=torch_dtype)
        # loader.init_random_weights skips a tied head by asking the model whether it is tied
        hf.tie_word_embeddings = bool(getattr(source.hf_config, "tie_word_embeddings", False))
        _route_experts_to_stacked(hf)
        loader.init_random_weights(hf, source.random_seed)
    return hf.eval()


_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def _route_experts_to_stacked(hf) -> None:
    """transformers 5 holds a MoE layer's experts stacked (experts.gate_up_proj [E, 2I, H], gate
    rows first; experts.down_proj [E, H, I]) where a checkpoint, like the synthesised one, names
    each expert's tensors: route those through the loader's own hooks (remap_weight and the
    parameter's weight_loader), as Baton's Qwen3-MoE does. Nothing to do for other models."""
    stacked = {n: p for n, p in hf.named_parameters() if n.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    if not stacked:
        return

    def remap(name: str):
        m = _EXPERT.match(name)
        if m is None:
            return None
        return f"{m[1]}.{'down_proj' if m[3] == 'down_proj' else 'gate_up_proj'}", (int(m[2]), m[3])

    def load(param, tensor, shard) -> None:
        expert, which = shard
        if which == "down_proj":
            param.data[expert].copy_(tensor)
        else:
            row = 0 if which == "gate_proj" else tensor.shape[0]
            param.data[expert, row:row + tensor.shape[0]].copy_(tensor)

    for param in stacked.values():
        param.weight_loader = load
    hf.remap_weight = remap


def run_transformers(args: argparse.Namespace, workload: OfflineWorkload, kv_bytes_per_token: int) -> dict:
    t0 = time.perf_counter()
    hf = load_hf_model(args.model, args.device, args.dtype)
    load_seconds = time.perf_counter() - t0
    mode = args.hf_mode
    if mode == "auto":
        mode = "continuous" if hasattr(hf, "continuous_batching_context_manager") else "static"
    attn = getattr(hf.config, "_attn_implementation", None)
    extra: dict = {}
    if mode == "continuous":
        cb = _cb_config(args, workload, kv_bytes_per_token, hf)
        extra["continuous_batching_config"] = {k: getattr(cb, k, None) for k in ("num_blocks", "page_size",
                                               "max_batch_tokens", "max_requests_per_batch")}
        wall, out_tokens, generated, attn = _continuous(hf, workload, args.seed, cb)
        desc = "transformers continuous batching (paged attention; generate_batch's manager)"
    else:
        wall, out_tokens, generated = _static(hf, workload, args.seed, args.hf_batch_size)
        desc = f"transformers padded static batching, chunks of {args.hf_batch_size}"
    return {"engine": "transformers", "mode": desc, "hf_mode": mode, "load_seconds": load_seconds,
            "attn_implementation": attn, **extra,
            "wall_seconds": wall, "prompt_tokens": workload.prompt_tokens, "output_tokens": out_tokens,
            "generated_tokens": generated, "output_tokens_per_s": out_tokens / wall,
            "total_tokens_per_s": (workload.prompt_tokens + out_tokens) / wall}


def _generation_config(temperature: float, max_new_tokens: int):
    from transformers import GenerationConfig
    sample = temperature > 0
    return GenerationConfig(do_sample=sample, temperature=temperature if sample else None,
                            top_k=0 if sample else None, top_p=1.0 if sample else None,
                            max_new_tokens=max_new_tokens, eos_token_id=-1, pad_token_id=0)


def _cb_config(args: argparse.Namespace, workload: OfflineWorkload, kv_bytes_per_token: int, hf):
    """The same limits as Baton's engine: batch tokens, sequences per batch, and on the CPU
    the same KV memory (transformers would otherwise size its cache from most of the RAM)."""
    from transformers import ContinuousBatchingConfig
    cb = ContinuousBatchingConfig(max_batch_tokens=args.max_num_batched_tokens,
                                  max_requests_per_batch=args.max_num_seqs)
    tokens = None
    if args.num_kv_blocks:
        tokens = args.num_kv_blocks * args.block_size
    elif args.kv_cache_memory:
        tokens = args.kv_cache_memory // kv_bytes_per_token
    elif args.device == "cpu":
        from baton.engine.runner.model_runner import cpu_kv_cache_default
        weights = sum(p.numel() * p.element_size() for p in hf.parameters())
        context = getattr(hf.config, "max_position_embeddings", 4096)
        tokens = cpu_kv_cache_default(weights, context * kv_bytes_per_token) // kv_bytes_per_token
    if tokens is not None:
        # no more than the whole workload needs at once: on the CPU transformers' masks grow with the cache
        lens = [len(p) + n for p, n in zip(workload.prompts, workload.output_lens, strict=True)]
        need = sum(math.ceil(n / cb.page_size) for n in lens) + 1
        cb.num_blocks = max(min(math.ceil(tokens / cb.page_size), need), math.ceil(max(lens) / cb.page_size) + 1)
    return cb


def _continuous(hf, workload: OfflineWorkload, seed: int, cb) -> tuple[float, int, int, str | None]:
    from transformers.generation.continuous_batching.utils import WorkloadHints
    torch.manual_seed(seed)
    warm = warmup_workload(workload, seed)
    hints = WorkloadHints(max_prompt_length=max(len(p) for p in workload.prompts),
                          max_generated_length=max(workload.output_lens), num_requests=len(workload.prompts))
    gen = _generation_config(workload.temperature, max(workload.output_lens))
    with hf.continuous_batching_context_manager(generation_config=gen, block=True, timeout=10,
                                                continuous_batching_config=cb, workload_hints=hints) as manager:
        attn = hf.config._attn_implementation
        _collect(manager, [manager.add_request(warm.prompts[0], max_new_tokens=warm.output_lens[0],
                                               eos_token_id=-1)], progress=False)
        t0 = time.perf_counter()
        ids = [manager.add_request(p, request_id=f"bench-{i}", max_new_tokens=n, eos_token_id=-1)
               for i, (p, n) in enumerate(zip(workload.prompts, workload.output_lens, strict=True))]
        results = _collect(manager, ids, progress=True)
        wall = time.perf_counter() - t0
    tokens = sum(len(r.generated_tokens) for r in results.values())
    return wall, tokens, tokens, attn


def _collect(manager, request_ids: list[str], progress: bool) -> dict:
    pending, results = set(request_ids), {}
    last_result = last_print = time.perf_counter()
    while pending:
        r = manager.get_result(timeout=1)
        now = time.perf_counter()
        if r is None:
            if not manager.is_running() or now - last_result > RESULT_TIMEOUT_S:
                raise RuntimeError(f"transformers' continuous batching stalled with {len(pending)} requests "
                                   "unfinished")
            continue
        if r.is_finished() and r.request_id in pending:
            if getattr(r, "error", None):
                raise RuntimeError(f"transformers failed request {r.request_id}: {r.error}")
            pending.discard(r.request_id)
            results[r.request_id] = r
            last_result = now
        if progress and now - last_print > 5:
            last_print = now
            print(f"[bench] transformers: {len(results)}/{len(request_ids)} done", file=sys.stderr, flush=True)
    return results


def _static(hf, workload: OfflineWorkload, seed: int, batch_size: int) -> tuple[float, int, int]:
    torch.manual_seed(seed)
    warm = warmup_workload(workload, seed)
    _generate_chunk(hf, warm.prompts, warm.output_lens, workload.temperature)
    t0 = time.perf_counter()
    generated = 0
    for i in range(0, len(workload.prompts), batch_size):
        generated += _generate_chunk(hf, workload.prompts[i:i + batch_size], workload.output_lens[i:i + batch_size],
                                     workload.temperature)
        print(f"[bench] transformers: {min(i + batch_size, len(workload.prompts))}/{len(workload.prompts)} done",
              file=sys.stderr, flush=True)
    return time.perf_counter() - t0, workload.output_tokens, generated


@torch.no_grad()
def _generate_chunk(hf, prompts: list[list[int]], output_lens: list[int], temperature: float) -> int:
    """Left-padded generate to the chunk's longest output; returns the tokens generated."""
    width = max(len(p) for p in prompts)
    dev = hf.device
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=dev)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=dev)
    n = max(output_lens)
    out = hf.generate(ids, attention_mask=mask, generation_config=_generation_config(temperature, n),
                      min_new_tokens=n)
    return (out.shape[1] - width) * len(prompts)
