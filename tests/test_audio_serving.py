"""Audio served: the router's rules for chat audio (clips collected in order, placeholders expanded
to their token counts, the other kind of media refused, bad clips named by their part), and a tiny
random Qwen2-Audio served by one prefill + one decode worker (the audio encoder runs on the
prefill side; the decode worker gets KV and positions only) and by a colocated worker, both giving
the offline engine's tokens, over gRPC and through the OpenAI client's input_audio parts; bad audio
is a 400 / INVALID_ARGUMENT that leaves no block held.

The refusal of audio by a text-only model is checked on the shared text-only stacks
(test_services.py, test_openai_api.py)."""
from __future__ import annotations

import base64
import re
import subprocess
import sys

import grpc
import openai
import pytest
from audio_helpers import AUDIO_BOS, AUDIO_EOS, AUDIO_PAD, save_tiny_audio_checkpoint, sine
from cluster import Cluster, Proc
from test_services import collect

from baton.engine.requests.sampling_params import SamplingParams
from baton.models.audio import AudioPlaceholders
from baton.router.images import ImagePolicy, by_kind
from baton.router.validation import chat_messages
from baton.serving.processes import free_port
from baton.v1 import router_pb2

MAX_TOKENS = 8
AUDIO = AudioPlaceholders.from_config({"model_type": "qwen2_audio", "audio_token_index": AUDIO_PAD,
                                       "audio_config": {"max_source_positions": 100}})
WAV, MP3 = sine(1.0), sine(0.6, hz=300, rate=8000, fmt="MP3")
CHATS = {"text": ["Tell me about the sea."], "wav": [(WAV, "wav"), "What is this sound?"],
         "mp3": ["Compare", (WAV, "wav"), "with", (MP3, "mp3")]}


def audio_part(data: bytes, fmt: str = "wav") -> router_pb2.ChatContentPart:
    return router_pb2.ChatContentPart(audio=router_pb2.Audio(data=data, format=fmt))


def chat_request(*parts, max_tokens: int = MAX_TOKENS) -> router_pb2.GenerateRequest:
    message = router_pb2.ChatMessage(role="user", parts=[
        router_pb2.ChatContentPart(text=p) if isinstance(p, str) else audio_part(*p) if isinstance(p, tuple) else p
        for p in parts])
    return router_pb2.GenerateRequest(chat=router_pb2.Chat(messages=[message]), sampling=router_pb2.SamplingParams(
        temperature=0, max_tokens=max_tokens, ignore_eos=True))


def openai_content(parts) -> list[dict]:
    return [{"type": "text", "text": p} if isinstance(p, str) else
            {"type": "input_audio", "input_audio": {"data": base64.b64encode(p[0]).decode(), "format": p[1]}}
            for p in parts]


# -- the router's rules, no workers -------------------------------------------------------------
def test_clips_are_collected_in_order_and_expanded_to_their_token_counts():
    policy = ImagePolicy("audio", AUDIO)
    clips = policy.collect(chat_request("hear", (WAV, "wav"), "and", (MP3, "MP3")))
    assert [c.part for c in clips] == ["chat.messages[0].parts[1]", "chat.messages[0].parts[3]"]
    assert [c.image.format for c in clips] == ["wav", "mp3"]
    policy.measure(clips)
    ids = policy.expand([1, AUDIO_BOS, AUDIO_PAD, AUDIO_EOS, 2, AUDIO_BOS, AUDIO_PAD, AUDIO_EOS], clips)
    assert ids == [1, AUDIO_BOS, *[AUDIO_PAD] * 25, AUDIO_EOS, 2, AUDIO_BOS, *[AUDIO_PAD] * 15, AUDIO_EOS]
    images, audios = by_kind(clips)
    assert images == [] and [a.data for a in audios] == [WAV, MP3]
    assert chat_messages(chat_request("hear", (WAV, "wav")).chat)[0]["content"] == [
        {"type": "text", "text": "hear"}, {"type": "audio"}]


@pytest.mark.parametrize("policy, req, says", [
    (ImagePolicy("vl", None), chat_request((WAV, "wav")), "model vl takes no audio (chat.messages[0].parts[0] is one)"),
    (ImagePolicy("audio", AUDIO), chat_request("x", router_pb2.ChatContentPart(image=router_pb2.Image(data=b"png"))),
     "model audio takes no images (chat.messages[0].parts[1] is one): send text only or audio parts"),
    (ImagePolicy("audio", AUDIO, max_images=1), chat_request((WAV, "wav"), (WAV, "wav")),
     "the chat has 2 audio clips; this server accepts at most 1"),
    (ImagePolicy("audio", AUDIO, max_image_bytes=100), chat_request((WAV, "wav")), "the audio clip is"),
    (ImagePolicy("audio", AUDIO), chat_request((b"", "wav")), "chat.messages[0].parts[0]: the audio clip has no bytes"),
    (ImagePolicy("audio", AUDIO), chat_request((WAV, "aiff")), "chat.messages[0].parts[0]: audio format 'aiff'"),
], ids=["text-only model", "an image to an audio model", "too many", "too large", "empty", "unknown format"])
def test_limits_and_other_media_are_refused_before_anything_is_decoded(policy, req, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        policy.collect(req)


@pytest.mark.parametrize("clip, says", [
    ((b"RIFF garbage, not a wave file at all", "wav"), "chat.messages[0].parts[0]: audio 0 could not be decoded"),
    ((sine(2.5), "wav"), "chat.messages[0].parts[0]: audio 0 is refused: it is 2.5 s long"),
    ((sine(0.005), "wav"), "too short for one audio token"),
], ids=["undecodable", "too long", "too short"])
def test_a_bad_clip_is_named_by_its_part(clip, says):
    policy = ImagePolicy("audio", AUDIO)
    with pytest.raises(ValueError, match=re.escape(says)):
        policy.measure(policy.collect(chat_request(clip)))


# -- a tiny Qwen2-Audio, served -----------------------------------------------------------------
@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """One prefill, one decode and one colocated worker; the cluster's router prefers the pair, a
    second router knows only the colocated worker, a third only the pair (so a 1P1D failure cannot
    hide behind a retry on the colocated worker). And the offline engine's answer to each chat."""
    from baton import LLM
    from baton.models.source import resolve_model
    root = tmp_path_factory.mktemp("audio")
    path = save_tiny_audio_checkpoint(root / "tiny-qwen2-audio", resolve_model(None).tokenizer_dir(), seed=3)
    llm = LLM(str(path), dtype="float32")
    chats = [[{"role": "user", "content": openai_content(parts)}] for parts in CHATS.values()]
    outs = llm.chat(chats, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    want = dict(zip(CHATS, outs, strict=True))
    del llm
    common = ["--model", str(path), "--dtype", "float32", "--num-kv-blocks", "32", "--block-size", "16"]
    c = Cluster.launch(root / "logs", prefill=1, decode=1, colocated=1, http=True, worker_args=common,
                       router_args=["--model", str(path)])
    try:
        port = free_port()
        solo = Proc("router-colocated", [sys.executable, "-m", "baton.router", "--port", str(port), "--model",
                                         str(path), "--colocated", c.worker("colocated-0").address],
                    f"127.0.0.1:{port}")
        c.procs.append(solo)
        solo.start(c.env, c.log_dir)
        port = free_port()
        pair = Proc("router-pair", [sys.executable, "-m", "baton.router", "--port", str(port), "--model", str(path),
                                    "--prefill", c.worker("prefill-0").address, "--decode", c.worker("decode-0").address],
                    f"127.0.0.1:{port}")
        c.procs.append(pair)
        pair.start(c.env, c.log_dir)
        solo.wait_ready()
        pair.wait_ready()
        yield c, solo, pair, want
    finally:
        c.stop()


def test_grpc_chats_give_the_offline_engines_tokens_disaggregated_and_colocated(served):
    c, solo, pair, want = served
    from baton.v1 import router_pb2_grpc
    stubs = {"1P1D": router_pb2_grpc.RouterStub(grpc.insecure_channel(pair.address)),
             "colocated": router_pb2_grpc.RouterStub(grpc.insecure_channel(solo.address)),
             "either": c.stub()}
    for route, stub in stubs.items():
        for name, parts in CHATS.items():
            ids, text, last = collect(stub, chat_request(*parts))
            assert (ids, text) == (want[name].token_ids, want[name].text), (route, name)
            assert last.usage.prompt_tokens == len(want[name].prompt_token_ids), (route, name)   # audio tokens in
    assert len({tuple(w.token_ids) for w in want.values()}) == 3                                 # the audio matters
    info = c.wait_blocks_free()                     # every block freed, nothing running (polled)
    assert {w.role for w in info.workers} == {"prefill", "decode", "colocated"}


def test_the_openai_client_with_input_audio_gets_the_same_text(served):
    c, _, _, want = served
    client = openai.OpenAI(base_url=c.http_url, api_key="unused", max_retries=0, timeout=60)
    r = client.chat.completions.create(model="tiny-qwen2-audio", temperature=0, max_tokens=MAX_TOKENS,
                                       extra_body={"ignore_eos": True},
                                       messages=[{"role": "user", "content": openai_content(CHATS["mp3"])}])
    assert r.choices[0].message.content == want["mp3"].text
    assert r.usage.prompt_tokens == len(want["mp3"].prompt_token_ids)


@pytest.mark.parametrize("clip, says", [
    ((b"RIFF....WAVE but not really", "wav"), "could not be decoded"),
    ((sine(0.0), "wav"), "audio 0"),
    ((sine(3.0), "wav"), "this model takes at most 2 s per clip"),
    (("%%% not base64", "wav"), "bad base64"),
    ((WAV, "flac8"), "'format' must be one of"),
], ids=["undecodable", "empty", "too long", "bad base64", "bad format"])
def test_bad_audio_is_400_through_the_openai_api(served, clip, says):
    c, _, _, _ = served
    client = openai.OpenAI(base_url=c.http_url, api_key="unused", max_retries=0, timeout=60)
    data = clip[0] if isinstance(clip[0], str) else base64.b64encode(clip[0]).decode()
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny-qwen2-audio", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "input_audio", "input_audio": {"data": data, "format": clip[1]}}]}])
    assert says in err.value.body["message"]


def test_bad_audio_over_grpc_is_invalid_argument_and_leaves_no_blocks_held(served):
    c, _, _, _ = served
    for parts, says in ((["hi", (b"ID3 not an mp3", "mp3")], "chat.messages[0].parts[1]: audio 0 could not be decoded"),
                        ([(sine(2.2), "wav")], "chat.messages[0].parts[0]: audio 0 is refused: it is 2.2 s long")):
        with pytest.raises(grpc.RpcError) as err:
            collect(c.stub(), chat_request(*parts))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert says in err.value.details()
    info = c.wait_blocks_free()
    assert all(w.healthy and w.kv_blocks_free == w.kv_blocks_total for w in info.workers)


def test_baton_generate_sends_audio_files_before_the_prompt(served, tmp_path):
    """`baton generate "..." --audio a.wav --audio b.mp3`: the CLI's answer is the router's for the
    same chat (clips first, then the prompt; each clip's format from its file name)."""
    c, _, _, _ = served
    (tmp_path / "a.wav").write_bytes(WAV)
    (tmp_path / "b.mp3").write_bytes(MP3)
    req = chat_request((WAV, "wav"), (MP3, "mp3"), "compare")
    req.sampling.ignore_eos = False                      # as the CLI sends it
    _, text, last = collect(c.stub(), req)
    out = subprocess.run([sys.executable, "-m", "baton", "generate", "compare", "--audio", str(tmp_path / "a.wav"),
                          "--audio", str(tmp_path / "b.mp3"), "--addr", c.router.address, "--temperature", "0",
                          "--max-tokens", str(MAX_TOKENS)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout == text and f"prompt {last.usage.prompt_tokens}," in out.stderr
