"""Baton's own config reader (models/model_config.py) and an engine core's light tokenizer
(engine/requests/tokenizer.py: CoreTokenizer) against transformers, which stays the reference:
every field Baton's models read, for every config Baton ships or tests with (the presets, the tiny
test configs, the embedded SmolLM2 model, every rope spelling, quantized checkpoints, a config
transformers writes whole and one that leaves every field to the defaults), so a wrong default
fails here and not as a subtly different model. And an engine core really imports no transformers.
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from baton.models.model_config import DEFAULTS, ModelConfig, read_config
from baton.models.presets import PRESETS
from tests.minicpm_reference import TINY_MINICPM

# every field Baton reads of a model's config (test_the_engine_reads_no_field_this_test_leaves_out keeps it whole)
READ_FIELDS = (
    "architectures", "attention_bias", "audio_config", "audio_token_id", "audio_token_index", "bos_token_id",
    "decoder_sparse_step", "dim_model_base", "eos_token_id", "head_dim", "hidden_act", "hidden_size",
    "image_processor", "image_token_id", "intermediate_size", "max_position_embeddings", "mlp_only_layers",
    "model_type", "moe_intermediate_size", "norm_topk_prob", "num_attention_heads", "num_experts",
    "num_experts_per_tok", "num_hidden_layers", "num_key_value_heads", "quantization_config", "rms_norm_eps",
    "rope_parameters", "rope_scaling", "rope_theta", "scale_depth", "scale_emb", "sparse_config", "text_config",
    "tie_word_embeddings", "video_token_id", "vision_config", "vision_end_token_id", "vision_start_token_id",
    "vocab_size")
MISSING = object()
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM", "minicpm": "MiniCPMForCausalLM"}
# test_rope_scaling's scalings, each in transformers 5's spelling and in transformers 4's
SCALINGS = [
    dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32768),
    dict(rope_type="yarn", factor=40, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1, mscale=1.0,
         mscale_all_dim=0.707),
    dict(rope_type="yarn", factor=2.0, original_max_position_embeddings=4096, attention_factor=1.25),
    dict(rope_type="yarn", factor=None, original_max_position_embeddings=2048),
    dict(rope_type="linear", factor=2.0),
    dict(rope_type="dynamic", factor=4.0),
    dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192),
    dict(rope_type="default"),
]
FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [32, 32]}


def _transformers_config(raw: dict):
    from transformers import AutoConfig

    from baton.models import minicpm_config
    minicpm_config.register()
    fields = json.loads(json.dumps(raw))
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def _written_whole(kind: str) -> dict:
    """What transformers writes for a config of `kind` (config.json as save_pretrained leaves it)."""
    return json.loads(_transformers_config({"model_type": kind, "architectures": [ARCHITECTURES[kind]]})
                      .to_json_string(use_diff=False))


def _configs() -> dict[str, dict]:
    configs = {f"preset {name}": fields for name, fields in PRESETS.items() if fields["model_type"] in DEFAULTS}
    configs["tiny minicpm (tests)"] = TINY_MINICPM
    for kind, arch in ARCHITECTURES.items():
        configs[f"{kind}, every field left to the defaults"] = {"model_type": kind, "architectures": [arch]}
        configs[f"{kind} as transformers writes it"] = _written_whole(kind)
        configs[f"{kind}, fp8 checkpoint"] = dict(PRESETS["tiny-llama"], model_type=kind, architectures=[arch],
                                                  quantization_config=FP8, torch_dtype="bfloat16", use_cache=True)
        for i, scaling in enumerate(SCALINGS):
            theta = {"rope_theta": 5e5}
            v5 = dict(scaling, **theta)
            v4 = {"type" if k == "rope_type" else k: v for k, v in scaling.items()}
            base = dict(PRESETS["tiny-qwen3"], model_type=kind, architectures=[arch], max_position_embeddings=4096)
            base.pop("rope_theta")
            configs[f"{kind}, rope {i} (transformers 5)"] = dict(base, rope_parameters=v5)
            configs[f"{kind}, rope {i} (transformers 4)"] = dict(base, rope_scaling=v4, **theta)
            configs[f"{kind}, rope {i}, no theta"] = dict(base, rope_scaling=dict(scaling))
    return configs


CONFIGS = _configs()


def _embedded_config() -> dict:
    from baton.models.source import resolve_model
    return json.loads((Path(resolve_model(None).weights_path) / "config.json").read_text())


def _assert_same_fields(raw: dict) -> None:
    mine, theirs = read_config(raw), _transformers_config(raw)
    assert isinstance(mine, ModelConfig)
    differ = {name: (getattr(mine, name, MISSING), getattr(theirs, name, MISSING)) for name in READ_FIELDS
              if getattr(mine, name, MISSING) != getattr(theirs, name, MISSING)}
    assert not differ, f"Baton's reader vs transformers' AutoConfig: {differ}"


@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_field_baton_reads_equals_transformers(name):
    _assert_same_fields(CONFIGS[name])


def test_the_embedded_models_config_reads_as_transformers_reads_it():
    _assert_same_fields(_embedded_config())


@pytest.mark.parametrize("raw", [
    PRESETS["tiny-qwen3-vl"], {"model_type": "mamba", "architectures": ["MambaForCausalLM"]},
    dict(PRESETS["tiny-llama"], partial_rotary_factor=0.5),
    dict(PRESETS["tiny-qwen3"], rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e4}}),
    dict(PRESETS["tiny-llama"], original_max_position_embeddings=1024),
], ids=["multimodal", "unknown type", "partial rotary", "per-layer rope", "top-level original length"])
def test_what_the_reader_was_not_checked_against_goes_to_autoconfig(raw):
    assert read_config(raw) is None


def test_resolve_model_reads_with_baton_only_when_asked(tmp_path):
    from baton.models.source import resolve_model
    assert isinstance(resolve_model("tiny-qwen3", baton_config=True).hf_config, ModelConfig)
    assert not isinstance(resolve_model("tiny-qwen3").hf_config, ModelConfig)     # a PretrainedConfig
    assert not isinstance(resolve_model("tiny-qwen3-vl", baton_config=True).hf_config, ModelConfig)


class _Recording:
    """A config that notes every field read of it (and of its sub-configs)."""

    def __init__(self, inner, read: set):
        self.__dict__.update(_inner=inner, _read=read)

    def __getattr__(self, name):
        if name.startswith("__") or name in ("_inner", "_read"):
            raise AttributeError(name)
        self._read.add(name)
        value = getattr(self._inner, name)
        return _Recording(value, self._read) if name.endswith("_config") and hasattr(value, "__dict__") else value


@pytest.mark.parametrize("model", [None, "tiny-llama", "tiny-qwen3", "tiny-qwen3-moe", "tiny-minicpm4"])
def test_the_engine_reads_no_field_this_test_leaves_out(model):
    """Start an engine on a config that records what is read of it and run a request with a stop
    string: every field read must be one READ_FIELDS compares."""
    from baton.engine.config import EngineConfig
    from baton.engine.llm_engine import LLMEngine
    from baton.engine.requests.sampling_params import SamplingParams
    from baton.engine.runner.model_runner import ModelRunner
    from baton.models.source import resolve_model
    config = EngineConfig(model=model, device="cpu", num_kv_blocks=64)
    source = resolve_model(model, baton_config=True)
    read: set = set()
    source.hf_config = _Recording(source.hf_config, read)
    engine = LLMEngine(config, runner=ModelRunner(config, source), tokens_only=True)
    engine.add_request(list(range(5, 30)), SamplingParams(temperature=0, max_tokens=3, stop=["zz"]))
    while engine.has_unfinished:
        engine.step()
    config_fields = {name for name in read if not name.startswith("_")} - {"to_dict"}
    assert config_fields <= set(READ_FIELDS), sorted(config_fields - set(READ_FIELDS))


# -- the engine core's tokenizer --------------------------------------------------------------

def _embedded_tokenizer_dir() -> str:
    from baton.models.source import resolve_model
    return resolve_model(None).tokenizer_dir()


def test_the_core_tokenizer_is_the_hf_tokenizers_vocabulary_decoding_and_eos():
    from transformers import AutoTokenizer

    from baton.engine.requests.tokenizer import CoreTokenizer, load_core_tokenizer
    folder = _embedded_tokenizer_dir()
    light, full = load_core_tokenizer(folder), AutoTokenizer.from_pretrained(folder)
    assert isinstance(light, CoreTokenizer)
    assert (len(light), light.eos_token_id) == (len(full), full.eos_token_id)
    assert light.backend_tokenizer.to_str() == full.backend_tokenizer.to_str()      # what llguidance is given
    ids = full("Paris, <|im_end|> café 東京 🙂")["input_ids"] + [0, 1, 2, len(full) - 1]
    for skip in (True, False):
        assert light.decode(ids, skip_special_tokens=skip) == full.decode(ids, skip_special_tokens=skip,
                                                                          clean_up_tokenization_spaces=False)
    assert light("Paris, café")["input_ids"] == full("Paris, café")["input_ids"]       # the full one, on demand


def _tokenizer_copy(tmp_path, edit) -> str:
    folder = Path(_embedded_tokenizer_dir())
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_text((folder / name).read_text())
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    edit(config)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return str(tmp_path)


@pytest.mark.parametrize("edit", [
    lambda c: c.update(tokenizer_class="GPT2Tokenizer"),
    lambda c: c.update(eos_token="<|not-in-the-vocabulary|>"),
    lambda c: c.update(additional_special_tokens=["Paris"]),
    lambda c: c.update(added_tokens_decoder={"49152": {"content": "<new>", "special": True}}),
], ids=["a tokenizer class of its own", "an eos it lacks", "a special token it has as a plain one",
        "an added token it lacks"])
def test_a_tokenizer_json_that_is_not_the_whole_tokenizer_loads_the_hf_one(tmp_path, edit):
    from baton.engine.requests.tokenizer import CoreTokenizer, load_core_tokenizer
    assert not isinstance(load_core_tokenizer(_tokenizer_copy(tmp_path, edit)), CoreTokenizer)


def test_grammars_through_the_core_tokenizer_mask_as_through_the_hf_one():
    import llguidance.numpy
    from transformers import AutoTokenizer

    from baton.engine.requests.structured_output import StructuredOutput, StructuredOutputs
    from baton.engine.requests.tokenizer import load_core_tokenizer
    folder = _embedded_tokenizer_dir()
    spec = StructuredOutput("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "string"}}}))
    seen = []
    for tokenizer in (load_core_tokenizer(folder), AutoTokenizer.from_pretrained(folder)):
        grammars = StructuredOutputs(tokenizer, 49152, [2])
        vocab = grammars.tokenizer
        matcher = grammars.state(spec, 0).matcher
        masks = []
        for token in tokenizer.backend_tokenizer.encode('{"a": "x', add_special_tokens=False).ids:
            mask = llguidance.numpy.allocate_token_bitmask(1, vocab.vocab_size)
            llguidance.numpy.fill_next_token_bitmask(matcher, mask, 0)
            masks.append(mask.tobytes())
            assert matcher.consume_token(token)
        seen.append((vocab.vocab_size, vocab.eos_tokens, [vocab.decode_bytes([t]) for t in range(len(tokenizer))],
                     masks))
    assert seen[0] == seen[1]


ENGINE_CORE_START = textwrap.dedent("""
    import json, sys
    from baton.engine.config import EngineConfig
    from baton.engine.llm_engine import LLMEngine
    from baton.engine.requests.sampling_params import SamplingParams
    from baton.engine.requests.structured_output import StructuredOutput
    for model in (None, "tiny-qwen3"):
        engine = LLMEngine(EngineConfig(model=model, device="cpu", num_kv_blocks=64), tokens_only=True)
        grammar = StructuredOutput("json_object", "")
        engine.add_request(list(range(5, 30)), SamplingParams(temperature=0, max_tokens=4, stop=["zz"],
                                                              structured=grammar))
        while engine.has_unfinished:
            engine.step()
    print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] == "transformers")))
""")


def test_an_engine_core_starts_and_serves_stops_and_grammars_without_importing_transformers():
    """What each worker start saves (~1.4 s of CPU): the engine core's engine reads the config
    and the tokenizer without transformers, and keeps it so through stop strings and grammars."""
    done = subprocess.run([sys.executable, "-c", ENGINE_CORE_START], cwd=Path(__file__).parents[1], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.splitlines()[-1]) == []
