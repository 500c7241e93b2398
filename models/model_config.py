"""A text model's config.json read without transformers: what an engine core needs of it, in a
millisecond rather than the ~1.3 s of CPU that importing transformers' config classes costs (they
pull in torch.distributed.tensor), for every worker that starts.

`read_config` gives an object carrying the config's fields as transformers' AutoConfig would, with
its class defaults for the fields Baton's models read and its rope standardization (transformers 5:
`rope_parameters` holds `rope_theta`, `rope_scaling` is the same dict). Anything it was not checked
against gets None, and the caller reads the config through AutoConfig instead: another model type,
a multimodal config, per-layer rope parameters. tests/test_model_config.py compares every field
Baton reads with AutoConfig's, for every config Baton ships or tests with.
"""
from __future__ import annotations

import copy

# The class defaults transformers (5.x) fills in, for the fields Baton reads; MiniCPM's are Baton's
# own class's (models/minicpm_config.py). A field a class lacks stays absent, as it does there.
_DECODER = dict(hidden_act="silu", rms_norm_eps=1e-6, tie_word_embeddings=False, vocab_size=151936,
                max_position_embeddings=32768, bos_token_id=None, eos_token_id=None)
DEFAULTS: dict[str, dict] = {
    "llama": dict(_DECODER, vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=None, max_position_embeddings=2048,
                  bos_token_id=1, eos_token_id=2, attention_bias=False, mlp_bias=False, head_dim=None),
    "qwen2": dict(_DECODER, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=32),
    "qwen3": dict(_DECODER, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=32, head_dim=128, attention_bias=False),
    "qwen3_moe": dict(_DECODER, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24,
                      num_attention_heads=32, num_key_value_heads=4, attention_bias=False, decoder_sparse_step=1,
                      moe_intermediate_size=768, num_experts_per_tok=8, num_experts=128, norm_topk_prob=False,
                      mlp_only_layers=None),
    "minicpm": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=None, hidden_act="silu",
                    max_position_embeddings=2048, rms_norm_eps=1e-6, rope_theta=10000.0, attention_bias=False,
                    scale_emb=1, dim_model_base=1, scale_depth=1, sparse_config=None, tie_word_embeddings=True),
}
DEFAULT_THETA = 10000.0          # transformers' RotaryEmbeddingConfigMixin.default_theta
KEEPS_THETA = {"minicpm"}        # classes that keep rope_theta as a field of their own
ALIASES = {"qwen3_moe": {"num_local_experts": "num_experts"}}   # transformers' attribute_map: name written -> read
# keys transformers transforms in ways this reader does not: such a config goes to AutoConfig
UNREAD_KEYS = {"partial_rotary_factor", "text_config", "vision_config", "audio_config",
               "per_layer_config", "original_max_position_embeddings"}
# what transformers pops from config.json instead of keeping (generation settings; GenerationConfig's)
GENERATION_KEYS = {"max_length", "min_length", "do_sample", "early_stopping", "num_beams", "temperature",
                   "top_k", "top_p", "typical_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
                   "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences", "output_scores",
                   "return_dict_in_generate", "forced_bos_token_id", "forced_eos_token_id",
                   "remove_invalid_values", "exponential_decay_length_penalty", "suppress_tokens",
                   "begin_suppress_tokens", "num_beam_groups", "diversity_penalty"}


class ModelConfig:
    """A config's fields as attributes (what Baton's models read of a transformers config)."""

    def __init__(self, fields: dict):
        self.__dict__.update(fields)

    def to_dict(self) -> dict:
        return copy.deepcopy(self.__dict__)

    def __repr__(self) -> str:
        return f"ModelConfig({self.__dict__.get('model_type')!r}, {len(self.__dict__)} fields)"


def read_config(raw: dict) -> ModelConfig | None:
    """`raw`: a parsed config.json (or a preset's fields). None where AutoConfig must read it."""
    kind = raw.get("model_type")
    aliases = ALIASES.get(kind, {})
    if kind not in DEFAULTS or UNREAD_KEYS & raw.keys() or any(a in raw and b in raw for a, b in aliases.items()):
        return None
    fields = {**DEFAULTS[kind], **{aliases.get(k, k): v for k, v in copy.deepcopy(raw).items()}}
    for key in GENERATION_KEYS | {"torch_dtype", "name_or_path", "_commit_hash"}:
        fields.pop(key, None)
    if fields.get("head_dim", 0) is None:
        fields["head_dim"] = fields["hidden_size"] // fields["num_attention_heads"]
    if fields.get("num_key_value_heads", 0) is None:
        fields["num_key_value_heads"] = fields["num_attention_heads"]
    if kind == "qwen3_moe" and fields["mlp_only_layers"] is None:
        fields["mlp_only_layers"] = []
    rope = _rope_parameters(fields, keep_theta=kind in KEEPS_THETA)
    if rope is None:
        return None
    fields["rope_parameters"] = fields["rope_scaling"] = rope     # one dict, as transformers' alias is
    return ModelConfig(fields)


def _rope_parameters(fields: dict, keep_theta: bool) -> dict | None:
    """transformers 5's rope standardization of a single (not per-layer) rope: `rope_scaling` or
    `rope_parameters`, with `rope_type` and `rope_theta` filled in; None for what it does not cover."""
    given = fields.pop("rope_scaling", None) or fields.get("rope_parameters") or {}
    if not isinstance(given, dict) or any(isinstance(v, dict) for v in given.values()):
        return None
    theta = fields.get("rope_theta", DEFAULT_THETA) if keep_theta else fields.pop("rope_theta", DEFAULT_THETA)
    rope = dict(given)
    rope.setdefault("rope_theta", theta)
    rope.setdefault("rope_type", rope.get("type", "default"))
    if rope["rope_type"] in ("llama3", "yarn", "longrope"):
        rope.setdefault("original_max_position_embeddings", fields["max_position_embeddings"])
    return rope
