"""Images served: the router's rules for chat images (limits, undecodable bytes named by their
part, placeholders expanded so every count includes image tokens), retries and migration that
keep the images, the OpenAI API's image_url parts, and a tiny random Qwen3-VL served by one
prefill + one decode worker giving the offline engine's tokens for chats with one image, two
images and none.

The refusal of images by a text-only model is checked on the shared text-only stack
(test_services.py, test_openai_api.py)."""
from __future__ import annotations

import asyncio
import base64
import io
import re
import subprocess
import sys

import grpc
import openai
import pytest
from cluster import Cluster
from fake_worker import FakeBus, FakeContext
from PIL import Image
from test_services import collect
from vl_helpers import build_vl_tokenizer, save_tiny_vl_checkpoint
from vl_helpers import png as noise_png

from baton.engine.requests.sampling_params import SamplingParams
from baton.models.multimodal import ImagePlaceholders
from baton.router.config import RouterConfig
from baton.router.images import ImagePolicy, check_limits
from baton.router.registry import Registry, Worker
from baton.router.server import RouterService
from baton.router.token_bus import TokenBus
from baton.router.validation import chat_messages
from baton.v1 import decode_pb2, prefill_pb2, router_pb2, worker_pb2

PAD, START, END = 151655, 151652, 151653          # Qwen3-VL's <|image_pad|>, <|vision_start|>, <|vision_end|>
VISION = ImagePlaceholders.from_config({"model_type": "qwen3_vl", "image_token_id": PAD,
                                        "vision_start_token_id": START, "vision_end_token_id": END,
                                        "vision_config": {"patch_size": 16, "spatial_merge_size": 2}})


def png(width: int, height: int, seed: int = 0) -> bytes:
    """A small PNG: a gradient that depends on the seed."""
    im = Image.new("RGB", (width, height))
    im.putdata([((x * 7 + seed * 40) % 256, (y * 5) % 256, (x * y + seed) % 256)
                for y in range(height) for x in range(width)])
    out = io.BytesIO()
    im.save(out, format="PNG")
    return out.getvalue()


def image_part(data: bytes, mime: str = "image/png") -> router_pb2.ChatContentPart:
    return router_pb2.ChatContentPart(image=router_pb2.Image(data=data, mime_type=mime))


def chat_request(*messages: router_pb2.ChatMessage, max_tokens: int = 0) -> router_pb2.GenerateRequest:
    req = router_pb2.GenerateRequest(chat=router_pb2.Chat(messages=messages))
    if max_tokens:
        req.sampling.CopyFrom(router_pb2.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    return req


def user(*parts) -> router_pb2.ChatMessage:
    return router_pb2.ChatMessage(role="user", parts=[
        router_pb2.ChatContentPart(text=p) if isinstance(p, str) else p for p in parts])


# -- the router's rules, no workers -------------------------------------------------------------
def test_images_are_collected_in_order_and_expanded_to_their_token_counts():
    policy = ImagePolicy("vl", VISION)
    a, b = png(64, 64), png(320, 200, seed=1)
    req = chat_request(user("what is this?", image_part(a)), router_pb2.ChatMessage(role="assistant", content="ok"),
                       user(image_part(b), "and this?"))
    images = policy.collect(req)
    assert [c.part for c in images] == ["chat.messages[0].parts[1]", "chat.messages[2].parts[0]"]
    assert [c.image.data for c in images] == [a, b] and images[0].image.mime_type == "image/png"
    policy.measure(images)
    n_a, n_b = VISION.num_tokens(images[0].image), VISION.num_tokens(images[1].image)
    ids = policy.expand([1, START, PAD, END, 2, START, PAD, END, 3], images)
    assert ids == [1, START, *[PAD] * n_a, END, 2, START, *[PAD] * n_b, END, 3]
    assert n_a == 64 and n_b > n_a                  # 64x64 is scaled up to the 65536-pixel minimum


def test_the_template_sees_image_parts_as_openai_style_parts():
    req = chat_request(router_pb2.ChatMessage(role="system", content="be brief"),
                       user("look:", image_part(png(8, 8)), "what is it?"), user("plain", " text"))
    assert chat_messages(req.chat) == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "look:"}, {"type": "image"},
                                     {"type": "text", "text": "what is it?"}]},
        {"role": "user", "content": "plain\n text"}]


@pytest.mark.parametrize("req,says", [
    (chat_request(user("hi", image_part(b"not an image at all"))), "chat.messages[0].parts[1]: image 0 could not"),
    (chat_request(user(image_part(png(8, 8)), image_part(png(9, 9)[:40]))), "chat.messages[0].parts[1]: image 1"),
], ids=["garbage", "truncated png"])
def test_an_undecodable_image_is_named_by_its_part(req, says):
    policy = ImagePolicy("vl", VISION)
    with pytest.raises(ValueError, match=re.escape(says)):
        policy.measure(policy.collect(req))


@pytest.mark.parametrize("policy,req,says", [
    (ImagePolicy("smollm2", None), chat_request(user("hi", image_part(png(8, 8)))), "model smollm2 takes no images"),
    (ImagePolicy("vl", VISION, max_images=1), chat_request(user(image_part(png(8, 8)), image_part(png(8, 8)))),
     "at most 1 per request (--max-images)"),
    (ImagePolicy("vl", VISION, max_image_bytes=100), chat_request(user(image_part(png(64, 64)))),
     "chat.messages[0].parts[0]: the image is"),
    (ImagePolicy("vl", VISION), chat_request(user(image_part(b""))), "chat.messages[0].parts[0]: the image has no"),
], ids=["text-only model", "too many", "too large", "empty"])
def test_limits_and_text_only_models_refuse_before_anything_is_decoded(policy, req, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        policy.collect(req)


def test_chat_shapes_that_make_no_sense_are_refused():
    both = router_pb2.ChatMessage(role="user", content="text", parts=[router_pb2.ChatContentPart(text="more")])
    with pytest.raises(ValueError, match=re.escape("chat.messages[0] sets both content and parts")):
        chat_messages(chat_request(both).chat)
    with pytest.raises(ValueError, match=re.escape("chat.messages[0].parts[1] is empty")):
        chat_messages(chat_request(user("x", router_pb2.ChatContentPart())).chat)
    policy = ImagePolicy("vl", VISION)
    with pytest.raises(ValueError, match="placeholder token .* but no image"):
        policy.expand([1, START, PAD, END], [])          # typed as text or token ids, with no image
    with pytest.raises(ValueError, match="2 image placeholders but 1 images"):
        policy.expand([START, PAD, END, START, PAD, END], policy.collect(chat_request(user(image_part(png(8, 8))))))


def test_image_limits_must_fit_one_prefill_message():
    check_limits(8, 6 << 20)
    with pytest.raises(ValueError, match="must fit"):
        check_limits(64, 8 << 20)
    with pytest.raises(ValueError, match="--max-images must be >= 0"):
        check_limits(-1, 10)


def test_the_last_pieces_meta_reaches_the_decode_side_over_the_memory_backend():
    """Qwen3-VL's position offset rides in the last KV piece's meta. The grpc and direct backends
    are checked carrying it in test_kvtransfer.py / test_kv_direct.py; this is the third."""
    from baton.engine.kv_handoff import KVPiece
    from baton.kvtransfer.backend import TransferDescriptor
    from baton.kvtransfer.layout import KVLayout
    from baton.kvtransfer.memory_backend import MemoryKVReceiver, MemoryKVSender
    from baton.kvtransfer.receiver import PendingTransfers

    layout = KVLayout(model="tiny", architecture="Qwen3VLForConditionalGeneration", dtype="float32",
                      block_size=16, num_layers=2, num_kv_heads=2, head_dim=32)
    landed = {}

    async def main():
        pending = PendingTransfers()
        receiver = MemoryKVReceiver(pending, layout, "vl-decode:1")
        receiver.add_to_server(None)
        try:
            pending.expect("t", layout.payload_nbytes(2), 20, lambda tid, payload, token, meta: landed.update(
                token=token, meta=meta), lambda tid, reason: landed.update(failed=reason))
            sender = MemoryKVSender("vl-decode:1")
            await sender.handshake(layout)
            out = await sender.open(TransferDescriptor("t", nbytes=layout.payload_nbytes(2)))
            block = bytes(layout.payload_nbytes(1))        # a block's worth: the backends check sizes
            await out.piece(KVPiece("r", 0, 1, block))
            await out.piece(KVPiece("r", 1, 1, block, None, 7, {"position_offset": "-42"}))
            await out.done()
        finally:
            await receiver.close()
    asyncio.run(main())
    assert landed == {"token": 7, "meta": {"position_offset": "-42"}}
# -- retries and migration keep the images: the router against fake workers, in this process -------
@pytest.fixture(scope="module")
def vl_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from baton.models.source import resolve_model
    path = build_vl_tokenizer(resolve_model(None).tokenizer_dir(), tmp_path_factory.mktemp("vl-tokenizer"))
    return AutoTokenizer.from_pretrained(path)


def vl_router(tokenizer, prefill=(), decode=(), colocated=()) -> tuple[RouterService, FakeWorkers]:
    """A router over fake workers (one FakeWorkers plays them all), for the tiny Qwen3-VL's placeholders."""
    from vl_helpers import tiny_vl_config
    fake = FakeWorkers()
    registry = Registry(list(prefill), list(decode), list(colocated), "tiny-vl")
    registry.workers = [fake.worker(a, role) for role, addrs in (("prefill", prefill), ("decode", decode),
                                                                 ("colocated", colocated)) for a in addrs]
    info = router_pb2.ModelInfo(name="tiny-vl", max_model_len=2048, vocab_size=len(tokenizer))
    cfg = RouterConfig(prefill=list(prefill), decode=list(decode), colocated=list(colocated))
    return RouterService(registry, tokenizer, info, cfg, vision=ImagePlaceholders.from_config(tiny_vl_config())), fake


def generate(svc: RouterService, req) -> list[router_pb2.GenerateResponse]:
    async def main():
        return [r async for r in svc.generate(req, FakeContext())]
    return asyncio.run(main())


def died() -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "worker died")


def finishing(prompt) -> list:
    usage = router_pb2.Usage(prompt_tokens=len(prompt), completion_tokens=1)
    return [decode_pb2.TokenChunk(token_ids=[13], finish_reason=router_pb2.FINISH_REASON_LENGTH, usage=usage)]


class FakeWorkers:
    """One prefill and two decode workers: the first stream anywhere dies after two tokens, the
    next one finishes the request. Every request the workers get is kept."""

    def __init__(self):
        self.prefills, self.admits, self.generates, self.streams = [], [], [], 0

    def worker(self, address, role):
        w = Worker(address, role, healthy=True)
        w.stub = w.prefill_stub = w.decode_stub = FakeStub(self)
        w.bus = TokenBus(w.stub, address)
        return w


class FakeStub:
    """One fake worker's RPCs (what they were sent goes to the shared FakeWorkers)."""

    def __init__(self, workers: FakeWorkers):
        self.w = workers
        self.bus: FakeBus | None = None

    def Subscribe(self, req, timeout=None):
        self.bus = FakeBus()
        return self.bus

    async def Prefill(self, req, timeout=None):
        self.w.prefills.append(req)
        return prefill_pb2.PrefillResponse(first_token=11)

    async def Admit(self, req, timeout=None):
        self.w.admits.append(req)
        self.w.streams += 1
        if self.w.streams == 1:
            self.bus.send(req.request_id, decode_pb2.TokenChunk(token_ids=[11]), decode_pb2.TokenChunk(token_ids=[12]),
                          died())
        else:
            self.bus.send(req.request_id, *finishing(req.prompt_token_ids))
        return decode_pb2.AdmitResponse(transfer_id=f"t{len(self.w.admits)}", kv_address="kv:1", backend="grpc")

    async def Start(self, req, timeout=None):                     # colocated: dies at once the first time
        self.w.generates.append(req)
        if len(self.w.generates) == 1:
            self.bus.send(req.request_id, died())
        else:
            self.bus.send(req.request_id, *finishing(req.prompt_token_ids))
        return decode_pb2.StartResponse()

    async def Abort(self, req, timeout=None):
        return worker_pb2.WorkerAbortResponse()


def test_a_migrated_stream_re_prefills_prompt_and_tokens_sent_with_the_same_images(vl_tokenizer):
    svc, fake = vl_router(vl_tokenizer, prefill=["p:1"], decode=["d1:1", "d2:1"])
    a, b = png(40, 30), png(64, 64, seed=2)
    out = generate(svc, chat_request(user("compare", image_part(a), "with", image_part(b)), max_tokens=3))
    assert [t for r in out for t in r.token_ids] == [11, 12, 13]
    first, second = fake.prefills
    assert list(second.prompt_token_ids) == [*first.prompt_token_ids, 11, 12]
    assert [i.data for i in first.images] == [i.data for i in second.images] == [a, b]
    assert first.images[0].mime_type == "image/png"
    assert [list(x.prompt_token_ids) for x in fake.admits] == [list(first.prompt_token_ids),
                                                               list(second.prompt_token_ids)]
    vision = svc.images.vision
    assert list(first.prompt_token_ids).count(vision.image_token_id) == 70 + 64       # 40x30 grows to 320x224
    assert out[-1].usage.prompt_tokens == len(first.prompt_token_ids)                  # image tokens count


def test_a_colocated_retry_sends_the_images_again(vl_tokenizer):
    svc, fake = vl_router(vl_tokenizer, colocated=["c1:1", "c2:1"])
    a = png(40, 30)
    out = generate(svc, chat_request(user(image_part(a), "what is it?"), max_tokens=3))
    assert [t for r in out for t in r.token_ids] == [13]
    first, second = fake.generates                      # the first worker died before any token
    assert first.request_id != second.request_id and first.prompt_token_ids == second.prompt_token_ids
    assert [i.data for i in first.images] == [i.data for i in second.images] == [a]


# -- a tiny Qwen3-VL served by 1 prefill + 1 decode worker ------------------------------------------
MAX_TOKENS = 8
IMAGE_A, IMAGE_B = noise_png(40, 30, 1), noise_png(64, 64, 2)
CHATS = {                                                      # OpenAI-style, as LLM.chat takes them
    "one image": [{"role": "user", "content": [{"type": "text", "text": "What is in this picture?"},
                                               {"type": "image", "image": IMAGE_A}]}],
    "two images": [{"role": "user", "content": [{"type": "text", "text": "compare"}, {"type": "image", "image": IMAGE_A},
                                                {"type": "text", "text": "with"}, {"type": "image", "image": IMAGE_B}]}],
    "text only": [{"role": "user", "content": "What is the capital of France?"}],
}


def as_grpc(chat: list[dict]) -> router_pb2.GenerateRequest:
    messages = [router_pb2.ChatMessage(role=m["role"], content=m["content"]) if isinstance(m["content"], str) else
                user(*(p["text"] if p["type"] == "text" else image_part(p["image"]) for p in m["content"]))
                for m in chat]
    return chat_request(*messages, max_tokens=MAX_TOKENS)


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    """The cluster, and what the offline engine answers to each chat (greedy)."""
    from baton import LLM
    from baton.models.source import resolve_model
    root = tmp_path_factory.mktemp("vl")
    path = save_tiny_vl_checkpoint(root / "tiny-vl", resolve_model(None).tokenizer_dir(), seed=2)
    llm = LLM(str(path), dtype="float32")
    outs = llm.chat(list(CHATS.values()), SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    want = dict(zip(CHATS, outs, strict=True))
    del llm
    # a 32-token prefill budget: the images' prompts prefill in chunks that split an image
    common = ["--model", str(path), "--dtype", "float32", "--num-kv-blocks", "64", "--block-size", "16"]
    c = Cluster.launch(root / "logs", prefill=1, decode=1, http=True, worker_args=common,
                       router_args=["--model", str(path)], extra={"prefill-0": ["--max-num-batched-tokens", "32"]})
    try:
        yield c, want, path
    finally:
        c.stop()


def test_grpc_chats_with_images_give_the_offline_engines_tokens(vl):
    c, want, _ = vl
    stub = c.stub()
    for name, chat in CHATS.items():
        ids, text, last = collect(stub, as_grpc(chat))
        assert ids == want[name].token_ids, name
        assert text == want[name].text, name
        assert last.usage.prompt_tokens == len(want[name].prompt_token_ids), name      # image tokens included
    assert len(set(map(tuple, (w.token_ids for w in want.values())))) == 3                # the images matter


def test_the_openai_client_with_a_data_url_gets_the_same_text(vl):
    c, want, _ = vl
    client = openai.OpenAI(base_url=c.http_url, api_key="unused", max_retries=0, timeout=60)
    r = client.chat.completions.create(model="tiny-vl", temperature=0, max_tokens=MAX_TOKENS,
                                       extra_body={"ignore_eos": True}, messages=[{"role": "user", "content": [
                                           {"type": "text", "text": "compare"},
                                           {"type": "image_url", "image_url": {"url": data_url(IMAGE_A)}},
                                           {"type": "text", "text": "with"},
                                           {"type": "image_url", "image_url": {"url": data_url(IMAGE_B)}}]}])
    assert r.choices[0].message.content == want["two images"].text
    assert r.usage.prompt_tokens == len(want["two images"].prompt_token_ids)


def test_bad_images_are_refused_and_leave_no_blocks_held(vl):
    c, _, _ = vl
    bad = as_grpc(CHATS["one image"])
    bad.chat.messages[0].parts[1].image.data = b"\x89PNG\r\n\x1a\n but not really"
    with pytest.raises(grpc.RpcError) as err:
        collect(c.stub(), bad)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "chat.messages[0].parts[1]: image 0 could not be decoded" in err.value.details()
    client = openai.OpenAI(base_url=c.http_url, api_key="unused", max_retries=0, timeout=60)
    for url, says in ((data_url(b"not an image"), "could not be decoded"),
                      ("https://example.com/cat.png", "does not fetch images from the network")):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="tiny-vl", max_tokens=4, messages=[{"role": "user", "content": [
                {"type": "text", "text": "what is it?"}, {"type": "image_url", "image_url": {"url": url}}]}])
        assert says in err.value.body["message"]
    info = c.wait_blocks_free()
    assert all(w.healthy and w.kv_blocks_free == w.kv_blocks_total for w in info.workers)


def test_a_colocated_worker_runs_a_chat_with_images_as_the_offline_engine(vl):
    """The colocated role (Decode.Generate) takes the images too; in this process, on the same checkpoint."""
    from baton.decode_service.server import DecodeWorker
    from baton.serving.wire import sampling_to_proto
    from baton.serving.worker.worker_config import parse_worker_args
    _, want, path = vl
    req = as_grpc(CHATS["two images"])

    async def main():
        worker = DecodeWorker(parse_worker_args("decode", ["--model", str(path), "--dtype", "float32", "--port", "0",
                                                           "--num-kv-blocks", "32", "--colocated"]))
        await worker.start()
        try:
            prompt = want["two images"].prompt_token_ids
            images = [p.image for p in req.chat.messages[0].parts if p.HasField("image")]
            sampling = sampling_to_proto(SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
            return [t async for chunk in worker.generate(decode_pb2.WorkerGenerateRequest(
                request_id="r", prompt_token_ids=prompt, sampling=sampling, images=images)) for t in chunk.token_ids]
        finally:
            await worker.server.drain_and_stop(0)
            await worker.stop()
    assert asyncio.run(main()) == want["two images"].token_ids


def test_baton_generate_sends_image_files_before_the_prompt(vl, tmp_path):
    """`baton generate "..." --image a.png --image b.png`: the CLI's answer is the offline engine's
    for the same chat (images first, then the prompt)."""
    from baton import LLM
    c, _, path = vl
    files = []
    for i, data in enumerate((IMAGE_A, IMAGE_B)):
        files += ["--image", str(tmp_path / f"{i}.png")]
        (tmp_path / f"{i}.png").write_bytes(data)
    chat = [{"role": "user", "content": [{"type": "image", "image": IMAGE_A}, {"type": "image", "image": IMAGE_B},
                                         {"type": "text", "text": "compare"}]}]
    want = LLM(str(path), dtype="float32").chat(chat, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))[0]
    out = subprocess.run([sys.executable, "-m", "baton", "generate", "compare", *files, "--addr", c.router.address,
                          "--temperature", "0", "--max-tokens", str(MAX_TOKENS)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout == want.text and f"prompt {len(want.prompt_token_ids)}," in out.stderr
