"""GGUF -> an HF-layout directory (config.json, model.safetensors, generation_config.json,
tokenizer files), through transformers' own GGUF loader: it dequantizes and maps every
architecture it knows (Llama, Qwen2, Qwen3, Qwen3-MoE, ...) the way the HF reference does, so
the weights Baton serves are the ones the reference would load from the same file. The weights
keep the file's own dtype: a bf16 or f16 GGUF gives bf16 or f16 safetensors (half the disk and
memory of float32); a quantized one (Q4_1, Q8_0, ...) is dequantized into float32, which holds
its values exactly.
"""
from __future__ import annotations

import json
import sys
import threading
import time
from collections import Counter
from pathlib import Path

CONVERTER_VERSION = "4"            # bump when the output changes: cached conversions are redone
PROGRESS_EVERY_S = 10.0
NOT_CONVERTIBLE = {"minicpm": "MiniCPM"}     # GGUF architecture -> name, for the refusal


def convert(gguf_path: Path, out_dir: Path, final_dir: Path | None = None, sampling: dict | None = None) -> None:
    """Write an HF directory for `gguf_path` into `out_dir` (which must not exist yet).
    `final_dir`: where it will live (for the messages); `sampling`: generation-config sampling
    defaults to record (a GGUF carries none)."""
    dtype = source_dtype(gguf_path)
    where = final_dir or out_dir
    t0 = time.perf_counter()
    # said before the heavy imports: a process waiting on this one's lock speaks up only after it
    print(f"[baton] converting {gguf_path.name} to an HF checkpoint ({dtype}) in {where} "
          f"(once per machine; about 20 s for the default model) ...", file=sys.stderr, flush=True)
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    done = threading.Event()
    ticker = threading.Thread(target=_tick, args=(done, t0), daemon=True)
    ticker.start()
    try:
        model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                     dtype=getattr(torch, dtype))
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    finally:
        done.set()
    out_dir.mkdir(parents=True)
    # transformers won't save a model it loaded from GGUF: write its weights ourselves
    tied = getattr(model.config, "tie_word_embeddings", False)
    weights = {k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)     # the saved weights are plain floats
    config["architectures"] = [type(model).__name__]
    config.pop("torch_dtype", None)
    config["dtype"] = config["torch_dtype"] = dtype     # transformers 5 reads dtype, 4.x torch_dtype
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save_pretrained(str(out_dir))
    gen = {k: v for k, v in model.generation_config.to_dict().items()
           if k in ("bos_token_id", "eos_token_id", "pad_token_id") and v is not None}
    gen.update(sampling or {})
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2))
    print(f"[baton] converted in {time.perf_counter() - t0:.1f}s -> {where}", file=sys.stderr, flush=True)


def source_dtype(gguf_path: Path) -> str:
    """The dtype the file's weight matrices are stored in (its 1-D norms are float32 in any GGUF),
    as a torch dtype name; before that, refuse a GGUF of an architecture Baton serves but
    transformers' GGUF loader cannot map (MiniCPM: llama.cpp has it, transformers has no MiniCPM class)."""
    from gguf import GGMLQuantizationType, GGUFReader
    reader = GGUFReader(str(gguf_path))
    _check_architecture(gguf_path, reader)
    kinds = Counter(t.tensor_type for t in reader.tensors if len(t.shape) >= 2)
    stored = kinds.most_common(1)[0][0] if kinds else GGMLQuantizationType.F32
    return {GGMLQuantizationType.BF16: "bfloat16", GGMLQuantizationType.F16: "float16"}.get(stored, "float32")


def _check_architecture(gguf_path: Path, reader) -> None:
    field = reader.get_field("general.architecture")
    arch = field.contents() if field is not None else None
    if arch in NOT_CONVERTIBLE:
        raise ValueError(f"{gguf_path.name}: a {NOT_CONVERTIBLE[arch]} GGUF cannot be imported (Baton converts GGUF "
                         f"through transformers' GGUF loader, which lacks {arch!r}); give the model as an HF "
                         f"directory (config.json + *.safetensors) instead")


def _tick(done: threading.Event, t0: float) -> None:
    while not done.wait(PROGRESS_EVERY_S):
        print(f"[baton] still converting ({time.perf_counter() - t0:.0f}s) ...", file=sys.stderr, flush=True)
