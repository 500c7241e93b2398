"""A decoder model's shape as the harness needs it: what the JSON records, how many
parameters each step multiplies, and how many KV bytes a token costs.

Mixture-of-experts models (Qwen3-MoE) split their weights in two: the shared ones (attention,
dense MLP layers, routers) every token multiplies, and the routed experts, of which a token
multiplies top_k per MoE layer (`active_matmul_params`) and a step reads only those its tokens
hit (`expected_experts_hit`)."""
from __future__ import annotations

from dataclasses import asdict, dataclass

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}


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
    num_experts: int = 0             # routed experts per MoE layer (0: a dense model)
    experts_per_token: int = 0       # top_k
    moe_intermediate: int = 0        # one expert's intermediate size
    moe_layers: int = 0              # layers whose MLP is routed (the others use `intermediate`)

    @classmethod
    def from_hf_config(cls, name: str, cfg) -> ModelShape:
        arch = (getattr(cfg, "architectures", None) or ["?"])[0]
        heads = cfg.num_attention_heads
        experts = getattr(cfg, "num_experts", 0) or 0
        if experts:
            from baton.models.layers.moe import is_moe_layer
            moe = dict(num_experts=experts, experts_per_token=cfg.num_experts_per_tok,
                       moe_intermediate=cfg.moe_intermediate_size,
                       moe_layers=sum(is_moe_layer(cfg, i) for i in range(cfg.num_hidden_layers)))
        else:
            moe = {}
        return cls(
            name=name, architecture=arch, layers=cfg.num_hidden_layers, hidden=cfg.hidden_size, heads=heads,
            kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
            vocab=cfg.vocab_size, intermediate=cfg.intermediate_size,
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            qkv_bias=arch == "Qwen2ForCausalLM" or bool(getattr(cfg, "attention_bias", False)),
            # Qwen3-VL: its Qwen3 decoder (the vision tower runs once per image, not per step)
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Qwen3VLForConditionalGeneration"), **moe,
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
        """Every matmul weight of the layers, all experts included."""
        return self.shared_matmul_params + self.moe_layers * self.num_experts * self.expert_params

    # -- mixture of experts (all zero / equal to the above for a dense model) ----------------------
    @property
    def expert_params(self) -> int:
        """One routed expert: gate, up, down."""
        return 3 * self.hidden * self.moe_intermediate

    @property
    def shared_matmul_params(self) -> int:
        """Matmul weights every step reads whole: attention, dense MLPs, the routers."""
        if not self.moe_layers:
            return self.layers * self.layer_matmul_params
        mlp = 3 * self.hidden * self.intermediate
        attention = self.layer_matmul_params - mlp
        return (self.layers * attention + (self.layers - self.moe_layers) * mlp
                + self.moe_layers * self.hidden * self.num_experts)

    @property
    def fp8_matmul_params(self) -> int:
        """The shared weights --quantization fp8 stores in one byte: the attention and dense MLP
        projections (the routers stay in the model dtype; the routed experts, e4m3 too, are counted
        per step by the experts it hits: roofline.CostModel.fp8_experts)."""
        return self.shared_matmul_params - self.moe_layers * self.hidden * self.num_experts

    @property
    def active_matmul_params(self) -> int:
        """Weights one token multiplies: the shared ones and top_k experts per MoE layer."""
        return self.shared_matmul_params + self.moe_layers * self.experts_per_token * self.expert_params

    def expected_experts_hit(self, tokens: int) -> float:
        """Distinct experts per MoE layer that `tokens` tokens hit, each picking top_k of E: the
        expectation E * (1 - (1 - k/E)^n) if routing is uniform and independent (an estimate:
        real routers are skewed, which hits fewer; random weights route near-uniformly)."""
        if not self.moe_layers or tokens <= 0:
            return 0.0
        e, k = self.num_experts, self.experts_per_token
        return e * (1 - (1 - k / e) ** tokens)

    def streamed_matmul_params(self, tokens: int) -> float:
        """Matmul weights a step of `tokens` tokens must read: the shared ones, plus per MoE layer
        the experts its tokens hit (expected_experts_hit)."""
        if not self.moe_layers:
            return self.shared_matmul_params
        return self.shared_matmul_params + self.moe_layers * self.expected_experts_hit(tokens) * self.expert_params

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
        if self.moe_layers:
            d["active_params"] = self.params - self.body_matmul_params + self.active_matmul_params
        return d


def shape_of(model: str) -> ModelShape:
    """The shape of a model name as the engine resolves it (preset, HF dir, .gguf, embedded)."""
    from baton.models import source as model_source
    source = model_source.resolve_model(model)
    return ModelShape.from_hf_config(source.name, source.hf_config)
