"""--fp8-rounding gptq: FP8 weights rounded with GPTQ's error feedback, calibrated on a fixed text.

`--quantization fp8` rounds each weight to the nearest e4m3 value of its row's grid (one scale per
output channel). With `gptq` the same grid and scales hold, and so does every kernel, but each
layer's columns are rounded in turn with the error spread over the columns not rounded yet
(models/layers/quantization.gptq_rows), weighed by what the layer's inputs look like on a
calibration text: the layer's output, not its weights, stays close (docs/benchmarks.md, on the
embedded SmolLM2-135M).

The calibration texts: CPython's own help topics (`pydoc_data.topics`: English prose about the
language) and the source of two stdlib modules (`collections`, `functools`: code), the first
CALIBRATION_WINDOW tokens of each; all in every CPython install. Layers are rounded in order, each
from a forward over the windows through the layers already rounded (as GPTQ does: a layer is
calibrated on the inputs the quantized model gives it); each forward stops once the layer's last
projection ran. Only the attention and MLP projections: a MoE's routed experts and anything outside
the decoder layers round to nearest. Every tensor-parallel rank runs it on its own shard
(row-parallel layers see their own slice of the inputs), so every rank and every worker of a model
computes the same weights; the texts are the Python version's, so workers on other Python versions
may round a few weights differently. What it costs at load (docs/benchmarks.md): ~35 s for
qwen3-0.6b and ~160 s for qwen3-8b on an H100, ~2 minutes for the 135M model on two CPU cores.
"""
from __future__ import annotations

import re
import time
from collections import defaultdict

import torch

from baton.engine.runner.kv_scales import cache_free_meta
from baton.models.forward_context import ForwardContext
from baton.models.layers.quantization import gptq_rows, quantizable, quantize_linear
from baton.progress import Progress

CALIBRATION_WINDOW = 1024               # tokens of each calibration text
_LAYER = re.compile(r"\.layers\.(\d+)\.")


def calibration_texts() -> list[str]:
    """English prose (CPython's help topics) and Python source (two stdlib modules)."""
    import collections
    import functools
    import inspect
    from pydoc_data.topics import topics
    return ["\n\n".join(topics[key] for key in sorted(topics)),
            inspect.getsource(collections) + "\n\n" + inspect.getsource(functools)]


def calibration_windows(tokenizer_dir: str, max_positions: int, tokens: int | None = None) -> list[torch.Tensor]:
    """The calibration token ids: the first CALIBRATION_WINDOW tokens of each text (fewer where the
    model's context is shorter); with `tokens`, whole windows of that width taken in turn from each
    text, from its start on, until there are that many (or the texts run out: GPTQ's calibration)."""
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    width = max(2, min(CALIBRATION_WINDOW, max_positions))
    texts = [tokenizer(text)["input_ids"] for text in calibration_texts()]
    if tokens is None:
        return [torch.tensor(t[:width]) for t in texts]
    windows, i = [], 0
    while sum(len(w) for w in windows) < tokens and any(len(t) >= (i + 1) * width for t in texts):
        windows += [torch.tensor(t[i * width:(i + 1) * width]) for t in texts if len(t) >= (i + 1) * width]
        i += 1
    return windows


class _LayerDone(Exception):
    """Raised by the last hooked projection of the layer being calibrated: the rest of the forward
    would not change its inputs."""


class _Inputs:
    """Sums of x^T x over the inputs of one layer's projections, from forward hooks."""

    def __init__(self, modules: list[tuple[str, torch.nn.Module]], device: torch.device):
        self.sums = {name: torch.zeros(m.weight.shape[1], m.weight.shape[1], dtype=torch.float32, device=device)
                     for name, m in modules}
        self.fired: set[str] = set()
        self.hooks = [m.register_forward_hook(self._hook(name)) for name, m in modules]

    def _hook(self, name: str):
        def record(_module, inputs, _output):
            x = inputs[0].reshape(-1, inputs[0].shape[-1]).float()
            self.sums[name].addmm_(x.t(), x)
            self.fired.add(name)
            if len(self.fired) == len(self.sums):
                raise _LayerDone
        return record

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()


@torch.inference_mode()
def round_with_gptq(model: torch.nn.Module, attention, scale: float, windows: list[torch.Tensor], ops, mode: str,
                    device: torch.device) -> int:
    """Every decoder layer's projections to e4m3 with GPTQ's rounding (models/layers/quantization.py
    `quantize_linear`, `gptq_rows`), layer by layer; returns how many projections. The rest (experts,
    layers outside the decoder's) are left to quantize_fp8."""
    def to_fp8(_name: str, m: torch.nn.Module, hessian: torch.Tensor) -> None:
        quantize_linear(m, ops, mode, gptq_rows(m.weight.data, hessian))
    return calibrate_layers(model, attention, scale, windows, device, to_fp8, "FP8 weights")


@torch.inference_mode()
def calibrate_layers(model: torch.nn.Module, attention, scale: float, windows: list[torch.Tensor],
                     device: torch.device, round_layer, what: str) -> int:
    """GPTQ's order: for each decoder layer in turn, the sums of x^T x over its projections' inputs on the
    calibration windows (through the layers already rounded), then round_layer(name, module, sums) for each
    projection; returns how many projections."""
    layers: dict[int, list[tuple[str, torch.nn.Module]]] = defaultdict(list)
    for name, module in model.named_modules():
        found = _LAYER.search(name + ".")
        if found is not None and quantizable(module):
            layers[int(found.group(1))].append((name, module))
    t0, done = time.perf_counter(), 0
    progress = Progress(f"rounding {what} (GPTQ): layer", len(layers))
    for i, (_, modules) in enumerate(sorted(layers.items())):
        inputs = _Inputs(modules, device)
        try:
            for ids in windows:
                inputs.fired.clear()
                n = ids.numel()
                ctx = ForwardContext(cache_free_meta(n, device), None, attention, scale)
                try:
                    model(ids.to(device), torch.arange(n, device=device), ctx)
                except _LayerDone:
                    pass
        finally:
            inputs.remove()
        for name, m in modules:
            round_layer(name, m, inputs.sums.pop(name))
            done += 1
        progress.update(i + 1)
    progress.done(f"rounded {done} projections' {what} (GPTQ, {len(layers)} layers) in {time.perf_counter() - t0:.1f}s")
    return done
