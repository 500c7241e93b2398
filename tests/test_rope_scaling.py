"""Rope scaling past the context a model was trained on (models/layers/rotary.py, rope_config.py):
YaRN, dynamic NTK and linear frequencies and YaRN's attention factor are transformers' own; a tiny
random Qwen3 served past original_max_position_embeddings gives transformers' greedy tokens (whole,
chunked and prefix-cached prefill; on every accelerator platform present, the CPU platform's);
--max-model-len may reach the scaled context and no further; both config spellings give one table;
a bad scaling (factor below 1, YaRN without its original length, an unknown rope_type) is refused.

Dynamic NTK is the kind a position-indexed table follows only in part (rotary_angles says why): the
tokens match transformers for a prompt within max_position_embeddings generating past it, and for
a longer prompt they match transformers fed that prompt one token at a time.
"""
from __future__ import annotations

import os

import pytest
import torch
from helpers import hf_greedy, save_tiny_checkpoint, tiny_hf_config
from test_platform_contract import ACCELERATORS, DEVICE, PARITY_DTYPE, options

from baton.engine import LLM, SamplingParams
from baton.models.layers.rope_config import check_max_model_len, rope_parameters
from baton.models.layers.rotary import (
    RotaryEmbedding,
    dynamic_ntk_frequencies,
    inverse_frequencies,
    rotary_magnitude,
)
from baton.models.presets import PRESETS
from baton.models.source import resolve_model

ORIGINAL = 64
REACH = 4 * ORIGINAL
# Qwen3's documented YaRN (factor 4 over 32768) at 1/512 scale: max_position_embeddings says 80 as
# Qwen3's 40960 does, so positions 80..255 exist only through the scaling
YARN = dict(max_position_embeddings=80,
            rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL})
DYNAMIC = dict(max_position_embeddings=ORIGINAL, rope_scaling={"rope_type": "dynamic", "factor": 4.0})


def _config(head_dim: int = 32, theta: float = 1e6, max_positions: int = 40960, **scaling):
    from transformers import Qwen3Config
    return Qwen3Config(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim, rope_theta=theta,
                       max_position_embeddings=max_positions, rope_scaling=scaling or None)


@pytest.mark.parametrize("head_dim,theta,max_positions,scaling", [
    (128, 1e6, 40960, dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32768)),    # Qwen3
    (64, 1e4, 163840, dict(rope_type="yarn", factor=40, original_max_position_embeddings=4096,       # DeepSeek
                           beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=0.707)),
    (64, 15e4, 131072, dict(rope_type="yarn", factor=32.0, original_max_position_embeddings=4096,     # gpt-oss
                            beta_fast=32.0, beta_slow=1.0, truncate=False)),
    (32, 1e6, 8192, dict(rope_type="yarn", factor=2.0, original_max_position_embeddings=4096, attention_factor=1.25)),
    (32, 1e6, 8192, dict(rope_type="yarn", factor=None, original_max_position_embeddings=2048)),    # factor implied
    (128, 1e4, 4096, dict(rope_type="linear", factor=2.0)),
    (128, 1e4, 4096, dict(rope_type="dynamic", factor=4.0)),
    (64, 5e5, 131072, dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                           original_max_position_embeddings=8192)),
])
def test_frequencies_and_attention_factor_equal_transformers(head_dim, theta, max_positions, scaling):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    config = _config(head_dim, theta, max_positions, **scaling)
    want, attention_factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](config, "cpu")
    base, params = rope_parameters(config)
    assert torch.equal(inverse_frequencies(head_dim, base, params, max_positions), want)
    assert rotary_magnitude(params, max_positions) == attention_factor


def test_dynamic_ntk_frequencies_past_the_window_equal_transformers():
    """As transformers recomputes them in a forward whose longest position is len - 1 (float32; the
    table's vectorized pow may round the last bit otherwise than its one-element one)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    config = _config(128, 1e4, 4096, rope_type="dynamic", factor=4.0)
    lens = [4097, 5000, 8191, 16384]
    got = dynamic_ntk_frequencies(128, 1e4, rope_parameters(config)[1], 4096, torch.tensor(lens))
    for row, n in zip(got, lens, strict=True):
        want, _ = ROPE_INIT_FUNCTIONS["dynamic"](config, "cpu", seq_len=torch.tensor(n))
        torch.testing.assert_close(row, want, rtol=2.4e-7, atol=0)


@pytest.mark.parametrize("overrides", [YARN, DYNAMIC], ids=["yarn", "dynamic"])
def test_table_row_is_what_transformers_rotates_each_decoded_position_with(overrides):
    """Row p: transformers' cos/sin for position p when it decodes one token at a time (YaRN's rows
    bit for bit, attention factor included; dynamic NTK's grow their base with p past the window)."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding
    config = tiny_hf_config("qwen3", **overrides)
    hf = Qwen3RotaryEmbedding(config)
    table = RotaryEmbedding(32, config.max_position_embeddings, *rope_parameters(config))
    assert table.cos.shape == (REACH, 32)
    x = torch.zeros(1, dtype=torch.float32)
    rows = [hf(x, torch.tensor([[p]])) for p in range(REACH)]
    cos, sin = (torch.cat([r[i][0] for r in rows]) for i in (0, 1))
    if overrides is YARN:
        assert torch.equal(table.cos, cos) and torch.equal(table.sin, sin)
    else:
        torch.testing.assert_close(table.cos, cos, rtol=0, atol=2e-5)
        torch.testing.assert_close(table.sin, sin, rtol=0, atol=2e-5)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """name -> (path, the transformers model) of a tiny random Qwen3 with that rope scaling."""
    from transformers import AutoModelForCausalLM

    tokenizer_dir = os.environ.get("BATON_TOKENIZER") or resolve_model(None).tokenizer_path
    out = {}
    for name, overrides in (("yarn", YARN), ("dynamic", DYNAMIC)):
        path = save_tiny_checkpoint("qwen3", tmp_path_factory.mktemp(name), tokenizer_dir, **overrides)
        out[name] = path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return out


def _prompt(n: int) -> list[int]:
    return torch.randint(3, 49152, (n,), generator=torch.Generator().manual_seed(n)).tolist()


def _baton(path, prompt: list[int], new: int, **kw) -> list[int]:
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64, max_model_len=REACH, **kw)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=new, ignore_eos=True))
    return out[0].token_ids


def _hf_fed_token_by_token(model, prompt: list[int], new: int) -> list[int]:
    """transformers' greedy tokens with the prompt fed one token at a time through its KV cache."""
    past, out, feed = None, [], list(prompt)
    with torch.no_grad():
        while len(out) < new:
            r = model(input_ids=torch.tensor([[feed.pop(0) if feed else out[-1]]]), past_key_values=past,
                      use_cache=True)
            past = r.past_key_values
            if not feed:
                out.append(int(r.logits[0, -1].argmax()))
    return out


def test_yarn_greedy_matches_transformers_past_the_original_context(tiny):
    """A 150-token prompt and 8 new tokens: positions 64..157 lie past original_max_position_embeddings
    and 80..157 past max_position_embeddings; a chunked prefill gives the same tokens, and so does the
    same prompt again, its first blocks (rotated past 64) read back from the prefix cache."""
    path, hf = tiny["yarn"]
    prompt = _prompt(150)
    want = hf_greedy(hf, [prompt], 8)[0]
    assert _baton(path, prompt, 8) == want
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64, max_model_len=REACH, max_num_batched_tokens=64,
              block_size=4)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    first, again = (llm.generate([prompt], params)[0] for _ in range(2))
    assert first.token_ids == want and again.token_ids == want
    assert again.cached_tokens > ORIGINAL


@pytest.mark.parametrize("kind", ACCELERATORS)
def test_yarn_on_each_accelerator_gives_the_cpu_platforms_greedy_tokens(kind, tiny):
    """The one table through each platform's model runner: chunked prefill at the platform's block
    size, decode graph-captured past original_max_position_embeddings. Layer ops plain torch, as in
    the platform contract's parity case (the fused ones round otherwise: the test below)."""
    path, _ = tiny["yarn"]
    prompt = _prompt(150)
    engine = dict(dtype=PARITY_DTYPE[kind], block_size=128, num_kv_blocks=16, max_num_seqs=4,
                  max_num_batched_tokens=128, max_model_len=REACH)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = LLM(str(path), device="cpu", **engine).generate([prompt], params)[0].token_ids
    llm = LLM(str(path), device=DEVICE[kind], **options(kind, fused_ops=False), **engine)
    assert llm.engine.runner.graphs is not None, "decode was kept eager"
    assert llm.generate([prompt], params)[0].token_ids == want


@pytest.mark.parametrize("kind", ACCELERATORS)
def test_fused_rotary_of_each_accelerator_applies_the_yarn_table(kind):
    """CUDA's fused Triton q/k-norm + rotary and the NPU's npu_rotary_mul (emulated in CI) read the
    YaRN table at positions past the original window, its attention factor (cos and sin above 1)
    included, as the plain torch rotary does."""
    from test_platform_contract import BF16_TOLERANCE, platform_for, rel_err

    from baton.engine.platforms.base import LayerOps
    rope = RotaryEmbedding(32, 80, 1e6, YARN["rope_scaling"])
    assert rope.cos.abs().max() > 1.1                            # 0.1 ln 4 + 1 = 1.139
    platform = platform_for(kind)
    g = torch.Generator().manual_seed(3)
    dev = lambda t: t.to(torch.bfloat16).to(platform.device)    # noqa: E731
    q, k, w = dev(torch.randn(40, 4, 32, generator=g)), dev(torch.randn(40, 2, 32, generator=g)), dev(torch.ones(32))
    positions = torch.arange(ORIGINAL, REACH, 4)[:40].to(platform.device)
    cos, sin = rope.cos.to(platform.device), rope.sin.to(platform.device)
    got = platform.ops.qk_norm_rotary(q, k, w, w, 1e-6, cos, sin, positions)
    want = LayerOps().qk_norm_rotary(q, k, w, w, 1e-6, cos, sin, positions)
    assert all(rel_err(a, b) < BF16_TOLERANCE for a, b in zip(got, want, strict=True))


def test_dynamic_ntk_greedy_matches_transformers_generating_past_the_window(tiny):
    """A prompt within max_position_embeddings (60 of 64) and 24 new tokens up to position 83: each
    new position rotates with its own grown base in both."""
    path, hf = tiny["dynamic"]
    prompt = _prompt(60)
    assert _baton(path, prompt, 24) == hf_greedy(hf, [prompt], 24)[0]


def test_dynamic_ntk_long_prompt_matches_transformers_decoding_it_token_by_token(tiny):
    """A 100-token prompt, past the window: transformers' one-forward prefill would rotate all its keys
    with the base of 100 tokens; fed token by token, each key keeps its own, as Baton's table does
    (whole or chunked prefill alike)."""
    path, hf = tiny["dynamic"]
    prompt = _prompt(100)
    want = _hf_fed_token_by_token(hf, prompt, 8)
    assert _baton(path, prompt, 8) == want
    assert _baton(path, prompt, 8, max_num_batched_tokens=64, block_size=4) == want


@pytest.mark.parametrize("overrides,reach", [
    (YARN, REACH),                                       # original x factor, past max_position_embeddings
    (DYNAMIC, REACH),                                    # max_position_embeddings x factor
    (dict(max_position_embeddings=ORIGINAL, rope_scaling={"rope_type": "linear", "factor": 2.0}), 2 * ORIGINAL),
    ({}, 512),                                           # no scaling: max_position_embeddings
])
def test_max_model_len_may_reach_the_scaled_context_and_no_further(overrides, reach):
    config = tiny_hf_config("qwen3", **overrides)
    check_max_model_len(config, reach)
    check_max_model_len(config, None)
    with pytest.raises(ValueError, match=f"max_model_len {reach + 1} is past the model's context.*{reach}"):
        check_max_model_len(config, reach + 1)


def test_qwen3_with_its_documented_yarn_reaches_131072_tokens():
    """Qwen3-8B's own config (max_position_embeddings 40960) with the rope_scaling Qwen documents
    (the qwen3-8b-yarn preset: qwen3-8b's fields and that rope_scaling, nothing else)."""
    from transformers import AutoConfig
    yarn = dict(PRESETS["qwen3-8b-yarn"])
    assert yarn.pop("rope_scaling") == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    assert yarn == PRESETS["qwen3-8b"]
    fields = dict(PRESETS["qwen3-8b-yarn"])
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    check_max_model_len(config, 131072)
    with pytest.raises(ValueError, match="rope_scaling yarn extends max_position_embeddings 40960 to 131072"):
        check_max_model_len(config, 131073)
    plain = AutoConfig.for_model(**dict(PRESETS["qwen3-8b"]))
    with pytest.raises(ValueError, match="max_position_embeddings is 40960; a checkpoint reaches further"):
        check_max_model_len(plain, 131072)


def _config_dir(root, name: str, text: str, path) -> str:
    """A checkpoint folder: `path`'s files, its config.json replaced by `text`."""
    out = root / name
    out.mkdir()
    for f in path.iterdir():
        if f.name != "config.json":
            (out / f.name).symlink_to(f)
    (out / "config.json").write_text(text)
    return str(out)


def _edited_config(path, edit) -> str:
    import json
    raw = json.loads((path / "config.json").read_text())
    edit(raw)
    return json.dumps(raw)


def _transformers4_spelling(raw: dict) -> None:
    params = raw.pop("rope_parameters")
    raw["rope_theta"] = params.pop("rope_theta")
    raw["rope_scaling"] = {"type": params.pop("rope_type"), **params}


def test_rope_scaling_and_rope_parameters_spellings_give_one_table(tiny, tmp_path):
    """transformers 5 writes `rope_parameters` (theta inside); a transformers 4 checkpoint has
    `rope_scaling` with "type" and a top-level rope_theta: both load the same YaRN table."""
    path, _ = tiny["yarn"]
    assert "rope_parameters" in _edited_config(path, lambda raw: None)
    old = _config_dir(tmp_path, "v4", _edited_config(path, _transformers4_spelling), path)
    read = [rope_parameters(resolve_model(where).hf_config) for where in (str(path), old)]
    assert read[0][0] == read[1][0] and read[0][1]["factor"] == read[1][1]["factor"] == 4.0
    tables = [RotaryEmbedding(32, 80, theta, scaling) for theta, scaling in read]
    assert torch.equal(tables[0].cos, tables[1].cos) and torch.equal(tables[0].sin, tables[1].sin)


def _scaling_edit(**fields):
    def edit(raw):
        raw["rope_parameters"].update(fields)
        for name, value in fields.items():
            if value is None:
                del raw["rope_parameters"][name]
    return edit


@pytest.mark.parametrize("edit,message", [
    (_scaling_edit(factor=0.5), r"rope_scaling yarn needs a factor >= 1 .*got 0.5"),
    (_scaling_edit(original_max_position_embeddings=None),
     "rope_parameters of type yarn states no original_max_position_embeddings"),
    (_scaling_edit(beta_fast=1, beta_slow=32), "yarn needs beta_fast >= beta_slow"),
    (_scaling_edit(attention_factor=0.0), "attention_factor must be positive"),
    (_scaling_edit(rope_type="dynamic", factor=0, original_max_position_embeddings=None),
     "rope_scaling dynamic needs a factor >= 1"),
    (_scaling_edit(rope_type="su"), r"'su' is not supported.*linear, dynamic, yarn, llama3, longrope"),
], ids=["factor-below-1", "no-original-length", "betas-backwards", "attention-factor-0", "dynamic-factor-0",
        "unknown-type"])
def test_a_bad_rope_scaling_is_refused_at_start(tiny, tmp_path, edit, message):
    """At engine start, before any weight loads (each folder here has the weights of a good config);
    with or without --max-model-len. transformers only warns about these (or, for the missing
    length, takes max_position_embeddings: check_stated_fields says why Baton does not)."""
    path, _ = tiny["yarn"]
    bad = _config_dir(tmp_path, "bad", _edited_config(path, edit), path)
    for max_model_len in (None, 100):
        with pytest.raises(ValueError, match=message):
            LLM(bad, dtype="float32", num_kv_blocks=64, max_model_len=max_model_len)


def test_engine_refuses_max_model_len_past_the_scaled_context_before_loading(tiny):
    path, _ = tiny["yarn"]
    with pytest.raises(ValueError, match=f"rope_scaling yarn extends max_position_embeddings 80 to {REACH}"):
        LLM(str(path), dtype="float32", num_kv_blocks=64, max_model_len=REACH + 1)
