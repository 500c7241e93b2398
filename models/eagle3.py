"""An EAGLE-3 draft head, as published EAGLE-3 checkpoints lay it out, for Llama / Qwen3 targets.

One decoder layer over `fc(concat(three of the target's hidden states: a low, a middle and a
high layer))` and the embedding of the token after them: the embedding and the hidden state are
each normed (`input_layernorm`, `hidden_norm`), concatenated (2 x hidden) into the layer's
attention, and the hidden state is the residual. Its own final norm and an LM head over a
*draft vocabulary* (`draft_vocab_size` ids; `d2t[d]` is the offset of draft id d to its target
id, as the checkpoints store it). The checkpoint: config.json (architectures
["LlamaForCausalLMEagle3"], hidden_size, num_attention_heads, ..., draft_vocab_size, and the
target's layers in `eagle_config.eagle_aux_hidden_state_layer_ids`) and safetensors named
`midlayer.*`, `fc.weight`, `norm.weight`, `lm_head.weight`, `d2t` (`t2d` unused), and
`embed_tokens.weight` where the head does not share the target's embedding.

A step of the head after the first feeds back its own hidden state before the final norm (no
fc: it has the head's width already). Its attention keeps KV in one extra layer of the target's
paged cache (engine/runner/model_runner.py): so its head shape must be the target's.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from baton.models.decoder import MLP, Attention, head_dim_of
from baton.models.forward_context import ForwardContext
from baton.models.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from baton.models.layers.linear import QKVParallelLinear, ReplicatedLinear, TPInfo
from baton.models.layers.norm import RMSNorm
from baton.models.layers.rope_config import context_length, rope_parameters
from baton.models.layers.rotary import RotaryEmbedding

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


def load_head_config(path: str | Path):
    """The head's config.json as a transformers LlamaConfig (ValueError: not an EAGLE-3 head)."""
    from transformers import LlamaConfig
    file = Path(path) / "config.json"
    if not file.is_file():
        raise ValueError(f"--speculative-model {path}: no config.json there (an EAGLE-3 head's directory: "
                         "config.json and *.safetensors)")
    raw = json.loads(file.read_text())
    arch = (raw.get("architectures") or ["?"])[0]
    if arch not in ARCHITECTURES:
        raise ValueError(f"--speculative-model {path}: architecture {arch!r} is not an EAGLE-3 head "
                         f"({', '.join(ARCHITECTURES)})")
    if raw.get("num_hidden_layers", 1) != 1:
        raise ValueError(f"--speculative-model {path}: heads of {raw['num_hidden_layers']} layers are not supported (1)")
    return LlamaConfig.from_dict(raw)


def aux_layer_ids(head_config, target_layers: int) -> tuple[int, int, int]:
    """The target layers whose *input* hidden states (the residual stream after the layer before)
    the head reads: the head's `eagle_aux_hidden_state_layer_ids`, else (2, L // 2, L - 3) as vLLM
    and SGLang default, clamped to 0..L (L: the output of the last layer, before its norm)."""
    eagle = getattr(head_config, "eagle_config", None) or {}
    ids = eagle.get("eagle_aux_hidden_state_layer_ids") or (2, target_layers // 2, target_layers - 3)
    if len(ids) != 3:
        raise ValueError(f"an EAGLE-3 head reads three target layers, its config names {list(ids)}")
    return tuple(min(max(int(i), 0), target_layers) for i in ids)


class Eagle3Layer(nn.Module):
    """The head's one decoder layer (checkpoint prefix `midlayer.`)."""

    def __init__(self, config, cache_layer: int, ops, dtype, rotary: RotaryEmbedding):
        super().__init__()
        tp = TPInfo()
        h = config.hidden_size
        self.self_attn = Attention(config, cache_layer, ops, tp, dtype, False, False, rotary)
        attn = self.self_attn        # its projection reads [norm(embedding), norm(hidden)]: twice the width
        attn.qkv_proj = QKVParallelLinear(2 * h, attn.head_dim, config.num_attention_heads, config.num_key_value_heads,
                                          bias=bool(getattr(config, "attention_bias", False)), tp=tp, dtype=dtype)
        self.mlp = MLP(config, ops, tp, dtype)
        self.input_layernorm = RMSNorm(h, config.rms_norm_eps, ops, dtype)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps, ops, dtype)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps, ops, dtype)
        self.norm_before_residual = bool(getattr(config, "norm_before_residual", False))

    def forward(self, positions, embeds, hidden, ctx: ForwardContext):
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = self.self_attn(positions, self._attention_input(embeds, normed), ctx)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual

    def write_kv(self, positions, embeds, hidden, ctx: ForwardContext) -> None:
        """Only the layer's K and V at the rows' slots, as `forward` writes them."""
        self.self_attn.write_kv(positions, self._attention_input(embeds, self.hidden_norm(hidden)), ctx)

    def _attention_input(self, embeds, normed_hidden):
        return torch.cat([self.input_layernorm(embeds), normed_hidden], dim=-1)


class Eagle3Head(nn.Module):
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }
    ignored_weights = ("t2d",)       # the target-to-draft mask: d2t says all the head needs
    tie_word_embeddings = False

    def __init__(self, config, target_config, cache_layer: int, ops, dtype, stored: set[str]):
        super().__init__()
        self.config = config
        h = config.hidden_size
        target_h = getattr(config, "target_hidden_size", None) or target_config.hidden_size
        self.vocab_size = target_config.vocab_size
        self.draft_vocab_size = getattr(config, "draft_vocab_size", None) or config.vocab_size
        self.aux_layers = aux_layer_ids(config, target_config.num_hidden_layers)
        self.fc = ReplicatedLinear(3 * target_h, h, bias=False, dtype=dtype)
        # the embedding: the head's own where the checkpoint has one, else the target's (set_embedding)
        own_embedding = "embed_tokens.weight" in stored
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, h, None, dtype) if own_embedding else None
        self._target_embedding: list[nn.Module] = []      # (a list: not a submodule, not in the head's weights)
        theta, scaling = rope_parameters(config)
        # (published heads may say a shorter context than their target serves: the table covers the target's,
        # rope-scaled reach included)
        positions = max(config.max_position_embeddings, target_config.max_position_embeddings)
        reach = context_length(target_config.max_position_embeddings, rope_parameters(target_config)[1])
        rotary = RotaryEmbedding(head_dim_of(config), positions, theta, scaling, length=reach)
        self.midlayer = Eagle3Layer(config, cache_layer, ops, dtype, rotary)
        self.norm = RMSNorm(h, config.rms_norm_eps, ops, dtype)
        self.lm_head = ParallelLMHead(self.draft_vocab_size, h, None, dtype)
        if "d2t" in stored:
            self.d2t = nn.Parameter(torch.zeros(self.draft_vocab_size, dtype=torch.int64), requires_grad=False)
            self.d2t.weight_loader = _copy_into
        elif self.draft_vocab_size == self.vocab_size:      # no map: draft ids are target ids
            self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.int64))
        else:
            raise ValueError(f"the EAGLE-3 head's draft vocabulary ({self.draft_vocab_size}) is not the target's "
                             f"({self.vocab_size}) and its checkpoint has no d2t map")
        self.num_kv_heads = self.midlayer.self_attn.num_kv_heads
        self.head_dim = self.midlayer.self_attn.head_dim

    @staticmethod
    def checkpoint_name(name: str) -> str:
        """Heads trained by some tools store the layer as `layers.0.` and prefix `model.`."""
        name = name.removeprefix("model.")
        return "midlayer." + name.removeprefix("layers.0.") if name.startswith("layers.0.") else name

    def set_embedding(self, embedding: nn.Module) -> None:
        self._target_embedding = [embedding]

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return (self.embed_tokens or self._target_embedding[0])(ids)

    def forward(self, next_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        """One pass over rows of (the token after a position, that position's hidden state: the
        target's fc'd, or the head's own from its pass before); returns the head's hidden states
        before its final norm ([T, hidden]: what the next pass feeds back, and `logits` reads)."""
        x, residual = self.midlayer(positions, self.embed(next_ids), hidden, ctx)
        return x + residual

    def write_kv(self, next_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                 ctx: ForwardContext) -> None:
        """What `forward` writes to the head's KV, and nothing more (no attention, no MLP, no output):
        a step after which nothing drafts keeps the head's KV current at a fraction of the cost."""
        self.midlayer.write_kv(positions, self.embed(next_ids), hidden, ctx)

    def logits(self, prenorm: torch.Tensor) -> torch.Tensor:
        """[T, draft vocabulary] logits of the token after each row (draft ids: `target_ids` maps them)."""
        return self.lm_head(self.norm(prenorm)).float()

    def target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]


def _copy_into(param, loaded, shard_id=None) -> None:
    param.data.copy_(loaded.to(param.dtype))


def stored_names(path: str | Path) -> set[str]:
    """The tensors the head's checkpoint holds, by the names the head gives them."""
    from safetensors import safe_open
    names = set()
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(file, framework="pt") as st:
            names |= {Eagle3Head.checkpoint_name(name) for name in st.keys()}
    return names


def build_head(path: str | Path, target: nn.Module, ops, dtype, device) -> Eagle3Head:
    """The head in `path`, loaded, for `target` (a decoder model); its KV goes to the cache layer
    after the target's. ValueError where the two do not fit together."""
    from baton.models.loader import load_weights
    config = load_head_config(path)
    tc = target.config
    with torch.device(device):
        head = Eagle3Head(config, tc, target.num_layers, ops, dtype, stored_names(path))
    if (head.num_kv_heads, head.head_dim) != (target.num_kv_heads, target.head_dim):
        raise ValueError(f"the EAGLE-3 head's attention ({head.num_kv_heads} KV heads of {head.head_dim}) differs "
                         f"from the target's ({target.num_kv_heads} of {target.head_dim}): its KV shares the target's "
                         "paged cache, so it must match")
    if config.vocab_size != tc.vocab_size:
        raise ValueError(f"the EAGLE-3 head's vocabulary ({config.vocab_size}) is not the target's ({tc.vocab_size})")
    head.set_embedding(target.model.embed_tokens)
    load_weights(head, path)
    return head.eval()


def random_head(target, draft_tokens: list[int] | None = None, seed: int = 0,
                std: float = 0.08) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, config.json) of a random-weight head for `target` (an HF config or a preset's dict),
    named as published heads name them; its draft vocabulary `draft_tokens` (default: the whole
    vocabulary). For tests and for costing a head in a real target's shapes: random weights guess
    badly, so it never shows a speed-up (that needs a trained head)."""
    get = target.get if isinstance(target, dict) else lambda key, default=None: getattr(target, key, default)
    h, heads, kv, vocab, layers = (get("hidden_size"), get("num_attention_heads"), get("num_key_value_heads"),
                                   get("vocab_size"), get("num_hidden_layers"))
    hd = get("head_dim") or h // heads
    inter = 2 * h
    draft = sorted(draft_tokens) if draft_tokens is not None else list(range(vocab))
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g) * std
    m = "midlayer."
    tensors = {m + "self_attn.q_proj.weight": rand(heads * hd, 2 * h), m + "self_attn.k_proj.weight": rand(kv * hd, 2 * h),
               m + "self_attn.v_proj.weight": rand(kv * hd, 2 * h), m + "self_attn.o_proj.weight": rand(h, heads * hd),
               m + "mlp.gate_proj.weight": rand(inter, h), m + "mlp.up_proj.weight": rand(inter, h),
               m + "mlp.down_proj.weight": rand(h, inter), m + "input_layernorm.weight": torch.ones(h),
               m + "hidden_norm.weight": torch.ones(h), m + "post_attention_layernorm.weight": torch.ones(h),
               "norm.weight": torch.ones(h), "fc.weight": rand(h, 3 * h), "lm_head.weight": rand(len(draft), h) * 10,
               "d2t": torch.tensor(draft) - torch.arange(len(draft)),
               "t2d": torch.zeros(vocab, dtype=torch.bool).index_fill_(0, torch.tensor(draft), True)}
    config = dict(architectures=["LlamaForCausalLMEagle3"], model_type="llama", hidden_size=h, intermediate_size=inter,
                  num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=kv, head_dim=hd,
                  vocab_size=vocab, draft_vocab_size=len(draft), rms_norm_eps=1e-6, hidden_act="silu",
                  rope_theta=get("rope_theta", 10000.0), max_position_embeddings=get("max_position_embeddings"),
                  eagle_config={"eagle_aux_hidden_state_layer_ids": [0, max(1, layers // 2), layers]
                                if layers < 6 else [2, layers // 2, layers - 3]})
    return tensors, config


def save_head(path: str | Path, tensors: dict[str, torch.Tensor], config: dict) -> Path:
    from safetensors.torch import save_file
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file({name: t.contiguous() for name, t in tensors.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))
    return path

