"""Qwen3-VL: greedy tokens equal transformers' Qwen3VLForConditionalGeneration (tiny random
config, fp32), through the offline API, with images batched, chunked, prefix-cached; image
digests in the prefix cache; the decode side's view of a multimodal sequence.

The reference is fed the outputs of transformers' own (PIL) Qwen2-VL image processor with
Qwen3-VL's settings. BATON_TEST_DEVICE=cuda:0 runs the same tests on a GPU (plus the decode
graph check).
"""
from __future__ import annotations

import io
import os

import numpy as np
import pytest
import torch
from helpers import Hook
from vl_helpers import (
    IMAGE_PAD,
    VISION_END,
    VISION_START,
    hf_vl_greedy,
    load_hf_vl,
    png,
    save_tiny_vl_checkpoint,
)

from baton import LLM, SamplingParams
from baton.engine.config import EngineConfig
from baton.engine.llm_engine import LLMEngine
from baton.engine.requests.tokenizer import render_chat
from baton.engine.runner.kv_blocks import Pieces
from baton.engine.scheduling.block_manager import BlockManager
from baton.engine.scheduling.multimodal import POSITION_OFFSET_META, MultimodalPrompt
from baton.engine.scheduling.sequence import Sequence
from baton.models.multimodal import ImageInput, mrope_positions, split_content_parts

DEVICE = os.environ.get("BATON_TEST_DEVICE", "cpu")
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
A, B = ImageInput(png(256, 256, 1)), ImageInput(png(320, 200, 2))        # 64 and 77 image tokens
C, D = ImageInput(png(256, 256, 3)), ImageInput(png(256, 256, 4))        # same size as A, other pixels


def user(*parts) -> list[dict]:
    content = [{"type": "text", "text": p} if isinstance(p, str) else {"type": "image", "image": p.data}
               for p in parts]
    return [{"role": "user", "content": content}]


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    from baton.models.source import resolve_model
    tokenizer_dir = os.environ.get("BATON_TOKENIZER") or resolve_model(None).tokenizer_path
    path = save_tiny_vl_checkpoint(tmp_path_factory.mktemp("vl") / "tiny-qwen3-vl", tokenizer_dir)
    return path, load_hf_vl(path, DEVICE)


@pytest.fixture(scope="module")
def llm(vl):
    return LLM(str(vl[0]), block_size=16, num_kv_blocks=96, device=DEVICE, dtype="float32")


def reference(llm: LLM, hf, conversation: list[dict], max_tokens: int = GREEDY.max_tokens) -> list[int]:
    """transformers' greedy tokens for the conversation, from the HF image processor's pixels."""
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    messages, images = split_content_parts(conversation)
    ids = render_chat(llm.tokenizer, messages)
    if images:
        ids = llm.engine.placeholders.expand(ids, images)
    processor = Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2, image_mean=[0.5] * 3,
                                         image_std=[0.5] * 3, size={"shortest_edge": 65536,
                                                                    "longest_edge": 16777216})
    pixels, grids = None, []
    if images:
        out = processor(images=[Image.open(io.BytesIO(i.data)) for i in images], return_tensors="np")
        pixels, grids = out["pixel_values"], [tuple(g) for g in out["image_grid_thw"].tolist()]
    return hf_vl_greedy(hf, ids, pixels, grids, max_tokens)


def test_chat_renders_and_expands_image_parts(llm):
    messages, images = split_content_parts(user(A, "What is it?"))
    ids = render_chat(llm.tokenizer, messages)
    assert ids.count(IMAGE_PAD) == 1 and ids[ids.index(IMAGE_PAD) - 1] == VISION_START
    expanded = llm.engine.placeholders.expand(ids, images)
    assert expanded.count(IMAGE_PAD) == 64 and expanded[expanded.index(IMAGE_PAD) + 64] == VISION_END
    with pytest.raises(ValueError, match="1 runs of image placeholders but 0 images"):
        llm.engine.add_request(expanded, GREEDY)
    with pytest.raises(ValueError, match="needs 64 placeholder tokens"):
        llm.engine.add_request(ids, GREEDY, images=[A])


def test_text_one_image_two_images_batched_match_transformers(llm, vl):
    chats = [[{"role": "user", "content": "Tell me about the sea."}], user(A, "What is this?"),
             user("Compare", A, "with", B, "please.")]
    got = llm.chat(chats, GREEDY)
    assert [o.token_ids for o in got] == [reference(llm, vl[1], c) for c in chats]


def test_chunked_prefill_splitting_images_and_a_prefix_hit(vl):
    """Chunks of 32 tokens cut both images apart; the second run of the same chat hits the
    prefix cache through the images (same digests) and still gives the same tokens."""
    llm = LLM(str(vl[0]), block_size=16, num_kv_blocks=96, max_num_batched_tokens=32, device=DEVICE,
              dtype="float32")
    chat = user("Look:", B, "and", A, "now.")
    want = reference(llm, vl[1], chat)
    first, second = llm.chat(chat, GREEDY)[0], llm.chat(chat, GREEDY)[0]
    assert first.token_ids == want and second.token_ids == want
    assert first.cached_tokens == 0 and second.cached_tokens >= 128


def test_same_size_images_do_not_share_cached_blocks(llm, vl):
    """Same placeholders, other pixels: the cache hit stops at the block the image starts in."""
    prefix = "A long shared question that fills a few blocks of sixteen tokens before the picture:"
    first = llm.chat(user(prefix, C, "Describe it."), GREEDY)[0]
    chat = user(prefix, D, "Describe it.")
    second = llm.chat(chat, GREEDY)[0]
    messages, images = split_content_parts(chat)
    ids = llm.engine.placeholders.expand(render_chat(llm.tokenizer, messages), images)
    image_start = ids.index(IMAGE_PAD)
    assert first.token_ids != second.token_ids
    assert second.cached_tokens == image_start // 16 * 16 > 0
    assert second.token_ids == reference(llm, vl[1], chat)


def test_mrope_positions_match_get_rope_index(vl):
    hf = vl[1]
    ids = [5, VISION_START] + [IMAGE_PAD] * 6 + [VISION_END, 7, VISION_START] + [IMAGE_PAD] * 4 + [VISION_END, 9]
    grids = [(1, 4, 6), (1, 4, 4)]
    pos, delta = mrope_positions(ids, [(2, 8), (11, 15)], grids, 2)
    x = torch.tensor([ids])
    want, want_delta = hf.model.get_rope_index(x.to(hf.device), (x == IMAGE_PAD).int().to(hf.device),
                                               torch.tensor(grids, device=hf.device))
    assert np.array_equal(pos, want[:, 0].cpu().numpy()) and delta == int(want_delta)


def test_decode_side_sequence_never_caches_image_blocks():
    """Without its images (decode worker) a sequence's blocks from the first image on stay
    out of the prefix cache, and its generated tokens sit at i + the landed offset."""
    ids = list(range(100, 120)) + [IMAGE_PAD] * 20 + list(range(200, 220))
    seq = Sequence("r", ids, GREEDY, 1024)
    seq.mm = MultimodalPrompt.remote(ids, IMAGE_PAD, -16)
    assert seq.mm.spans == [(20, 40)] and not seq.mm.images_available
    bm = BlockManager(16, 8)
    bm.allocate(seq, len(ids))
    seq.num_computed_tokens = len(ids)
    bm.register_full_blocks(seq)
    assert seq.num_hashed_blocks == 2 and len(bm.cached) == 2          # blocks 0-1: text only
    assert seq.mm.rope_positions(60, 62).tolist() == [[44, 45]] * 3


@pytest.mark.skipif(not DEVICE.startswith("cuda"), reason="decode CUDA graphs: run with BATON_TEST_DEVICE=cuda:0")
def test_decode_graphs_give_the_eager_tokens(vl, llm):
    eager = LLM(str(vl[0]), block_size=16, num_kv_blocks=96, device=DEVICE, dtype="float32", enforce_eager=True)
    chats = [user(A, "What is this?"), user("Compare", A, "with", B, "please.")]
    assert llm.engine.runner.graphs is not None
    assert [o.token_ids for o in llm.chat(chats, GREEDY)] == [o.token_ids for o in eager.chat(chats, GREEDY)]




def test_disaggregated_request_decodes_at_the_offset_and_a_preempted_one_ends_with_an_error(vl, llm):
    """Prefill engine (images, vision) -> KV pieces + meta -> decode engine that never sees the
    images: the generated tokens equal transformers' (the offset came with the meta). With KV
    for only the two prompts, the second to join is preempted; it cannot be recomputed without
    its images, so it ends with an error while the first finishes."""
    chats = [user(A, "What is this?"), user("Look", C, "here.")]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    prefill = LLMEngine(EngineConfig(model=str(vl[0]), block_size=16, num_kv_blocks=64, device=DEVICE,
                                     dtype="float32"), handoff=Hook())
    prompts = []
    for k, chat in enumerate(chats):
        messages, images = split_content_parts(chat)
        ids = prefill.placeholders.expand(render_chat(prefill.tokenizer, messages), images)
        prefill.add_request(ids, params, request_id=f"r{k}", hand_off_kv=True, images=images)
        prompts.append(ids)
    while prefill.has_work:
        prefill.step()
    blocks = sum(-(-len(ids) // 16) for ids in prompts)
    decode = LLMEngine(EngineConfig(model=str(vl[0]), block_size=16, num_kv_blocks=blocks, device=DEVICE,
                                    dtype="float32"), handoff=Hook())
    for k, ids in enumerate(prompts):
        pieces = [p for p in prefill.handoff.pieces if p.request_id == f"r{k}"]
        assert pieces[-1].meta[POSITION_OFFSET_META] == str(prefill_offset(prefill, ids, chats[k]))
        ticket = decode.reserve(f"r{k}", ids, params)
        assert ticket.land(Pieces(tuple((p.first_block, p.num_blocks, p.data) for p in pieces)),
                           pieces[-1].first_token, pieces[-1].meta)
        decode.handoff.landed.append(ticket)
    outs: dict[str, list] = {"r0": [], "r1": []}
    errors = {}
    while decode.has_unfinished:
        for o in decode.step():
            outs[o.request_id] += o.new_token_ids
            if o.error:
                errors[o.request_id] = o.error
    assert outs["r0"] == reference(llm, vl[1], chats[0], params.max_tokens)
    assert list(errors) == ["r1"] and "images are not on this worker" in errors["r1"]
    # the failed request's blocks came back, once, on both sides
    assert decode.block_manager.num_free_blocks == blocks and not decode.has_unfinished
    assert prefill.block_manager.num_free_blocks == 64 and not prefill.has_unfinished


def prefill_offset(engine, ids, chat) -> int:
    _, images = split_content_parts(chat)
    return MultimodalPrompt.for_prompt(ids, images, engine.placeholders).position_offset


def test_qwen3_vl_keeps_the_vision_language_protocol_the_engine_talks_to(llm):
    from pathlib import Path

    from baton.engine.runner import vision_step
    from baton.models.vision_language import VisionLanguageModel
    model = llm.engine.runner.model
    assert isinstance(model, VisionLanguageModel) and model.image_embed_dim == model.config.text_config.hidden_size
    assert "qwen3_vl" not in Path(vision_step.__file__).read_text()      # the engine names no model
