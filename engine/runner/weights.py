"""The runner's model, loaded: its layers built on the platform's device, its weights read from the
checkpoint (or drawn at random), and its linear layers quantized (--quantization, else the
checkpoint's own method: FP8, or AWQ / GPTQ INT4 kept packed; FP8 weights rounded with GPTQ on request, engine/runner/fp8_rounding.py).
"""
from __future__ import annotations

import sys
import time

import torch

from baton.engine.config import EngineConfig
from baton.engine.platforms import Platform
from baton.engine.runner.tensor_parallel import rank_devices
from baton.models.decoder import fuse_fp8_inputs
from baton.models.layers import custom_all_reduce
from baton.models.layers.expert_parallel import hot_experts
from baton.models.layers.int4 import INT4_METHODS, finish_int4
from baton.models.layers.quantization import checkpoint_method, quantize_fp8, quantize_w8a8
from baton.models.loader import build_model, init_random_weights, load_weights
from baton.models.source import ModelSource

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def model_dtype(config: EngineConfig, platform: Platform) -> torch.dtype:
    """--dtype, else the platform's default."""
    return DTYPES[config.dtype] if config.dtype else platform.default_dtype()


def redundant_experts(config: EngineConfig) -> tuple[int, ...]:
    """The hot experts that get a second copy (--ep-redundant-experts of --ep-expert-load's profile)."""
    if not config.ep_redundant_experts:
        return ()
    return hot_experts(config.ep_expert_load, config.ep_redundant_experts)


def load_model(config: EngineConfig, source: ModelSource, platform: Platform, dtype: torch.dtype,
               tp_rank: int = 0, tp_group=None) -> tuple[torch.nn.Module, str | None]:
    """(the model, ready to run; its quantization method, None: none)."""
    t0 = time.perf_counter()
    torch.manual_seed(config.seed)
    with torch.device(platform.device):
        model = build_model(source.hf_config, dtype, platform.device, platform.ops,
                            tp_rank=tp_rank, tp_size=config.tp_size, tp_group=tp_group,
                            expert_parallel=config.expert_parallel, redundant_experts=redundant_experts(config))
    if source.weights_path is None:
        init_random_weights(model, source.random_seed)
    else:
        load_weights(model, source.weights_path)
    model.eval()
    method = quantize(model, config, source, platform, dtype)
    attach_all_reduce(model, config, platform, tp_rank, tp_group)
    if time.perf_counter() - t0 > 5:
        print(f"[baton] model {source.name} ready in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    return model, method


def attach_all_reduce(model: torch.nn.Module, config: EngineConfig, platform: Platform, tp_rank: int,
                      tp_group) -> None:
    """--all-reduce: the tensor-parallel layers' small all-reduces over CUDA symmetric memory, its buffer
    mapped by every rank now, before KV sizing and graph capture; else torch.distributed's."""
    if config.tp_size == 1 or tp_group is None:
        return
    devices = rank_devices(config.device, config.tp_size, config.tp_devices)
    reducer = custom_all_reduce.choose(config.all_reduce, tp_group, tp_rank, devices, config.deterministic,
                                       platform.dist_backend)
    if reducer is not None:
        custom_all_reduce.install(model, reducer)


def quantize(model: torch.nn.Module, config: EngineConfig, source: ModelSource, platform: Platform,
             dtype: torch.dtype) -> str | None:
    """--quantization, else what the checkpoint was quantized with: the linear layers' weights
    to FP8 or int8 (models/layers/quantization.py), their bf16 copies going back to the device first;
    or an AWQ / GPTQ checkpoint's INT4 weights, loaded packed, laid out for the platform (models/layers/int4.py)."""
    stored = checkpoint_method(source.hf_config)
    method = config.quantization or stored
    if method is None:
        return None
    if config.deterministic:
        raise ValueError(f"--deterministic does not cover quantized matmuls, and this checkpoint is {method}: "
                         "serve it without --deterministic")
    if stored in INT4_METHODS:
        if config.quantization is not None:
            raise ValueError(f"this checkpoint is INT4 ({stored}) and has no bf16 weights to quantize with "
                             f"--quantization {config.quantization}: serve it without --quantization")
        finish_int4(model, platform, dtype)
    elif method == "w8a8":
        platform.int8_linear()               # ValueError where the platform has no int8 GEMM path
        quantize_w8a8(model, platform)
    else:
        mode = platform.fp8_linear()          # ValueError where the platform has no FP8 matmul
        if config.fp8_rounding == "gptq":
            _round_with_gptq(model, source, platform, mode)
        quantize_fp8(model, platform.ops, mode)
        fuse_fp8_inputs(model)                # the norms and SiLU-and-mul before them quantize
    if platform.runtime is not None and hasattr(platform.runtime, "empty_cache"):
        platform.runtime.empty_cache()      # the KV cache is sized from what is free now
    return method


def _round_with_gptq(model: torch.nn.Module, source: ModelSource, platform: Platform, mode: str) -> None:
    """--fp8-rounding gptq: the decoder layers' projections rounded layer by layer, calibrated on a
    fixed text (engine/runner/fp8_rounding.py); quantize_fp8 then does the rest to nearest."""
    from baton.engine.runner import fp8_rounding
    if checkpoint_method(source.hf_config) is not None:
        raise ValueError("--fp8-rounding gptq rounds bf16 weights at load; this checkpoint's weights are "
                         "already quantized: serve it without --fp8-rounding")
    hf = source.hf_config
    windows = fp8_rounding.calibration_windows(source.tokenizer_dir(),
                                               getattr(hf, "max_position_embeddings", fp8_rounding.CALIBRATION_WINDOW))
    fp8_rounding.round_with_gptq(model, platform, model.head_dim ** -0.5, windows, platform.ops, mode,
                                 platform.device)
