"""A decoder model's shape as the harness needs it: what the JSON records, how many
parameters each step multiplies, and how many KV bytes a token costs."""
from __future__ import annotations

from dataclasses import asdict, dataclass

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(slots=True, frozen=True)
class ModelShape:
    name: str
    architecture: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    intermediate: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False

    @classmethod
    def from_hf_config(cls, name: str, cfg) -> ModelShape:
        arch = (getattr(cfg, "architectures", None) or ["?"])[0]
        heads = cfg.num_attention_heads
        return cls(
            name=name, architecture=arch, layers=cfg.num_hidden_layers, hidden=cfg.hidden_size, heads=heads,
            kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
            vocab=cfg.vocab_size, intermediate=cfg.intermediate_size,
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            qkv_bias=arch == "Qwen2ForCausalLM" or bool(getattr(cfg, "attention_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
        )

    # -- parameters ---------------------------------------------------------------------------
    @property
    def layer_matmul_params(self) -> int:
        """Weights one token multiplies in one layer: q, k, v, o, gate, up, down."""
        q = self.heads * self.head_dim
        kv = self.kv_heads * self.head_dim
        return self.hidden * (q + 2 * kv) + q * self.hidden + 3 * self.hidden * self.intermediate

    @property
    def body_matmul_params(self) -> int:
        return self.layers * self.layer_matmul_params

    @property
    def head_params(self) -> int:
        """The LM head (vocab x hidden); with tied embeddings it is the embedding table."""
        return self.vocab * self.hidden

    @property
    def small_params(self) -> int:
        """Norm weights and biases: read every step, no matmul FLOPs to speak of."""
        per_layer = 2 * self.hidden
        if self.qk_norm:
            per_layer += 2 * self.head_dim
        if self.qkv_bias:
            per_layer += (self.heads + 2 * self.kv_heads) * self.head_dim
        return self.layers * per_layer + self.hidden

    @property
    def params(self) -> int:
        """Unique parameters (a tied embedding counted once), as the checkpoint holds them."""
        embeddings = self.head_params * (1 if self.tie_word_embeddings else 2)
        return self.body_matmul_params + self.small_params + embeddings

    # -- KV cache -----------------------------------------------------------------------------
    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V of every layer for one token."""
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes

    def to_json(self) -> dict:
        d = asdict(self)
        d["params"] = self.params
        return d


def shape_of(model: str) -> ModelShape:
    """The shape of a model name as the engine resolves it (preset, HF dir, .gguf, embedded)."""
    from baton.models import source as model_source
    source = model_source.resolve_model(model)
    return ModelShape.from_hf_config(source.name, source.hf_config)
