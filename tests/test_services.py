"""The disaggregated system end to end: real router, prefill and decode processes on
loopback, real weights, real KV transfers."""
from __future__ import annotations

import concurrent.futures as cf
import os
import time

import grpc
import pytest
from cluster import Cluster

from baton.engine import SamplingParams
from baton.kvtransfer import registry as kv_registry
from baton.v1 import decode_pb2_grpc, prefill_pb2_grpc, router_pb2, worker_pb2

pytestmark = pytest.mark.timeout(600)



@pytest.fixture(scope="module", params=["grpc", pytest.param("nixl", marks=pytest.mark.skipif(
    not kv_registry.spec("nixl").available(), reason="needs nixl-cu13 (make setup installs it)"))])
def cluster(request, tmp_path_factory):
    """grpc: the session's shared stack (separate processes); nixl: `baton serve --kv-backend nixl`."""
    if request.param == "grpc":
        yield request.getfixturevalue("pd_cluster")
        return
    c = Cluster.serve(tmp_path_factory.mktemp("serve-nixl"), ["--kv-backend", "nixl", "--num-kv-blocks", "256",
                                                             "--max-num-seqs", "32"])
    yield c
    c.stop()


def greedy(max_tokens: int, **kw) -> router_pb2.SamplingParams:
    return router_pb2.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def collect(stub, req, timeout=120):
    """(token ids, text, last response) of one streamed Generate."""
    ids, text, last = [], "", None
    for resp in stub.Generate(req, timeout=timeout):
        ids += resp.token_ids
        text += resp.text
        last = resp
    return ids, text, last


PROMPTS = ["The quick brown fox", "def quicksort(arr):", "La capitale de la France est",
           "東京は日本の", "1, 2, 3,", "Once upon a time there was a dragon who loved tea and"] * 3


LENGTHS = [8 + (i * 5) % 24 for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def offline_answers(embedded_llm):
    """The offline engine's greedy answers of PROMPTS (computed once: both stacks are held to them)."""
    return embedded_llm.generate(PROMPTS, [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                                           for n in LENGTHS])


def test_concurrent_greedy_requests_match_the_offline_engine(cluster, offline_answers):
    lengths, want = LENGTHS, offline_answers
    stub = cluster.stub()
    with cf.ThreadPoolExecutor(len(PROMPTS)) as pool:
        futs = [pool.submit(collect, stub, router_pb2.GenerateRequest(text=p, sampling=greedy(n)))
                for p, n in zip(PROMPTS, lengths, strict=True)]
        got = [f.result() for f in futs]
    for (ids, text, last), w in zip(got, want, strict=True):
        assert ids == w.token_ids
        assert text == w.text
        assert last.finish_reason == router_pb2.FINISH_REASON_LENGTH
        assert last.usage.completion_tokens == len(ids)
    cluster.wait_blocks_free()


def test_chat_request_answers_paris(cluster):
    req = router_pb2.GenerateRequest(sampling=router_pb2.SamplingParams(temperature=0, max_tokens=32))
    req.chat.messages.add(role="user", content="What is the capital of France?")
    ids, text, last = collect(cluster.stub(), req)
    assert "Paris" in text
    assert last.usage.prompt_tokens > 0 and last.request_id


def test_a_conversations_second_turn_sends_only_the_kv_the_decode_worker_lacks(pd_cluster, embedded_llm):
    """Turn 2 is turn 1's prompt and answer and a new question: the decode worker reuses every full
    block of turn 1 it holds, its answer's included (--decode-prefix-reuse, on by default), the
    prefill worker pushes the KV of the rest only, and the tokens are the offline engine's."""
    from test_kv_warm import scrape
    bs, urls = 16, pd_cluster.metrics_urls

    def counters() -> tuple[float, float]:
        out = scrape(urls["prefill-0"]).get(("baton_kv_transfer_bytes_total", (("direction", "out"),)), 0.0)
        return out, scrape(urls["decode-0"]).get(("baton_pd_reused_tokens_total", ()), 0.0)

    def turn(ids: list[int], n: int) -> tuple[list[int], int, int]:
        """(answer, bytes pushed, blocks reused) of one request, once the workers' counters have it."""
        pd_cluster.wait_blocks_free()
        before, deadline = counters(), time.monotonic() + 10
        got = collect(pd_cluster.stub(), router_pb2.GenerateRequest(tokens=router_pb2.TokenIds(ids=ids),
                                                                     sampling=greedy(n)))[0]
        while (after := counters())[0] == before[0] and time.monotonic() < deadline:
            time.sleep(0.1)
        return got, int(after[0] - before[0]), int(after[1] - before[1]) // bs

    turn1 = embedded_llm.apply_chat_template([{"role": "user", "content": "Name three rivers of Europe."}])
    answer, bytes1, reused1 = turn(turn1, 24)
    turn2 = turn1 + answer + embedded_llm.engine.tokenize(" Which of them is the longest?")
    second, bytes2, reused2 = turn(turn2, 12)
    want = embedded_llm.generate([turn2], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    assert second == want.token_ids
    assert reused2 == (len(turn1) + len(answer) - 1) // bs > reused1     # turn 1's blocks, its answer's too
    blocks1, blocks2 = -(-len(turn1) // bs) - reused1, -(-len(turn2) // bs) - reused2
    assert bytes1 and bytes2 * blocks1 == bytes1 * blocks2               # the same bytes a block: only those sent


def test_model_and_server_info(cluster):
    stub = cluster.stub()
    info = stub.GetModelInfo(router_pb2.GetModelInfoRequest(), timeout=5)
    assert info.name == "smollm2-135m-instruct" and info.architecture == "LlamaForCausalLM"
    assert info.vocab_size == 49152 and info.max_model_len > 0 and list(info.eos_token_ids)
    roles = sorted(w.role for w in cluster.server_info().workers)
    assert roles == ["decode", "prefill"]


def test_both_workers_speak_the_stacks_kv_backend_and_the_router_picks_it(cluster, request):
    backend = request.node.callspec.params["cluster"]
    spoken = {}
    for w in cluster.server_info().workers:
        with grpc.insecure_channel(w.address) as ch:
            stub = (prefill_pb2_grpc.PrefillStub if w.role == "prefill" else decode_pb2_grpc.DecodeStub)(ch)
            spoken[w.role] = list(stub.GetStatus(worker_pb2.GetStatusRequest(), timeout=5).kv_backends)
    assert spoken["prefill"] == spoken["decode"] == kv_registry.spoken(backend)
    assert kv_registry.pick(spoken["prefill"], spoken["decode"], same_accelerator=False) == backend
    if backend == "nixl":         # the decode worker registered its KV cache: transfers land in place
        assert "nixl: KV lands in place" in cluster.router.log.read_text(errors="replace")


def _start_stream(stub, rid: str, max_tokens=400, timeout=120):
    req = router_pb2.GenerateRequest(request_id=rid, text="Count slowly: one, two, three,",
                                     sampling=greedy(max_tokens))
    return stub.Generate(req, timeout=timeout)


def test_client_cancel_frees_blocks_on_both_sides(cluster):
    stream = _start_stream(cluster.stub(), "cancel-me")
    next(stream)                      # streaming has begun
    stream.cancel()
    cluster.wait_blocks_free()


def test_abort_rpc_ends_the_stream_and_frees_blocks(cluster):
    stub = cluster.stub()
    stream = _start_stream(stub, "abort-me")
    next(stream)
    assert stub.Abort(router_pb2.AbortRequest(request_id="abort-me"), timeout=5).found
    with pytest.raises(grpc.RpcError) as err:
        for _ in stream:
            pass
    assert err.value.code() == grpc.StatusCode.CANCELLED
    assert not stub.Abort(router_pb2.AbortRequest(request_id="abort-me"), timeout=5).found
    cluster.wait_blocks_free()


def test_deadline_expiry_frees_blocks(cluster):
    stream = _start_stream(cluster.stub(), "slow", max_tokens=2000, timeout=1.5)
    with pytest.raises(grpc.RpcError) as err:
        for _ in stream:
            pass
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    cluster.wait_blocks_free()


BAD_REQUESTS = [
    ("no input", dict()),
    ("empty text", dict(text="")),
    ("empty tokens", dict(tokens=router_pb2.TokenIds(ids=[]))),
    ("token outside vocab", dict(tokens=router_pb2.TokenIds(ids=[1, 2, 999999]))),
    ("prompt over context", dict(tokens=router_pb2.TokenIds(ids=[5] * 9000))),
    ("empty chat", dict(chat=router_pb2.Chat())),
    ("bad chat role", dict(chat=router_pb2.Chat(messages=[router_pb2.ChatMessage(role="wizard", content="x")]))),
    ("negative temperature", dict(text="hi", sampling=router_pb2.SamplingParams(temperature=-1))),
    ("nan temperature", dict(text="hi", sampling=router_pb2.SamplingParams(temperature=float("nan")))),
    ("top_p zero", dict(text="hi", sampling=router_pb2.SamplingParams(top_p=0))),
    ("top_p above one", dict(text="hi", sampling=router_pb2.SamplingParams(top_p=1.01))),
    ("negative top_k", dict(text="hi", sampling=router_pb2.SamplingParams(top_k=-3))),
    ("max_tokens zero", dict(text="hi", sampling=router_pb2.SamplingParams(max_tokens=0))),
    ("stop token outside vocab", dict(text="hi", sampling=router_pb2.SamplingParams(stop_token_ids=[10**7]))),
    ("empty stop string", dict(text="hi", sampling=router_pb2.SamplingParams(stop=[""]))),
    ("too many stop strings", dict(text="hi", sampling=router_pb2.SamplingParams(stop=["x"] * 17))),
    ("bad request id", dict(request_id="has spaces and /slashes", text="hi")),
    ("overlong request id", dict(request_id="r" * 500, text="hi")),
]


@pytest.mark.parametrize("name,fields", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_router_input_is_invalid_argument(cluster, name, fields):
    with pytest.raises(grpc.RpcError) as err:
        collect(cluster.stub(), router_pb2.GenerateRequest(**fields), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert err.value.details()


def test_images_to_a_text_only_model_are_refused(cluster):
    image = router_pb2.ChatContentPart(image=router_pb2.Image(data=b"\x89PNG\r\n\x1a\n", mime_type="image/png"))
    chat = router_pb2.Chat(messages=[router_pb2.ChatMessage(role="user", parts=[
        router_pb2.ChatContentPart(text="What is in this picture?"), image])])
    with pytest.raises(grpc.RpcError) as err:
        collect(cluster.stub(), router_pb2.GenerateRequest(chat=chat, sampling=greedy(4)), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "model smollm2-135m-instruct takes no images (chat.messages[0].parts[1] is one)" in err.value.details()


def test_audio_to_a_text_only_model_is_refused(cluster):
    clip = router_pb2.ChatContentPart(audio=router_pb2.Audio(data=b"RIFF\0\0\0\0WAVE", format="wav"))
    chat = router_pb2.Chat(messages=[router_pb2.ChatMessage(role="user", parts=[
        clip, router_pb2.ChatContentPart(text="What is this sound?")])])
    with pytest.raises(grpc.RpcError) as err:
        collect(cluster.stub(), router_pb2.GenerateRequest(chat=chat, sampling=greedy(4)), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "model smollm2-135m-instruct takes no audio (chat.messages[0].parts[0] is one)" in err.value.details()


def test_servers_are_healthy_and_clean_after_bad_input(cluster):
    info = cluster.wait_blocks_free()
    assert all(w.healthy for w in info.workers)
    ids, _, _ = collect(cluster.stub(), router_pb2.GenerateRequest(text="Hello", sampling=greedy(4)))
    assert len(ids) == 4


def test_stop_strings_through_the_router(cluster, embedded_llm):
    base = embedded_llm.generate(["1, 2, 3, 4,"], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0]
    ids, text, last = collect(cluster.stub(), router_pb2.GenerateRequest(
        text="1, 2, 3, 4,", sampling=greedy(30, stop=[" 8"])))
    assert last.finish_reason == router_pb2.FINISH_REASON_STOP
    assert text == base.text[:base.text.index(" 8")]


def test_seeded_sampling_is_reproducible_through_the_router(cluster):
    sp = router_pb2.SamplingParams(temperature=0.9, top_p=0.95, seed=77, max_tokens=12, ignore_eos=True)
    a = collect(cluster.stub(), router_pb2.GenerateRequest(text="A poem:", sampling=sp))[0]
    b = collect(cluster.stub(), router_pb2.GenerateRequest(text="A poem:", sampling=sp))[0]
    assert a == b and len(a) == 12


def test_duplicate_request_id_is_refused_while_running(cluster):
    stub = cluster.stub()
    first = _start_stream(stub, "dup-id")
    next(first)
    with pytest.raises(grpc.RpcError) as err:
        collect(stub, router_pb2.GenerateRequest(request_id="dup-id", text="hi", sampling=greedy(2)))
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
    first.cancel()
    cluster.wait_blocks_free()


def test_router_without_workers_is_unavailable(tmp_path):
    from baton.serving.processes import free_port
    c = Cluster(tmp_path, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    port = free_port()
    dead = f"127.0.0.1:{free_port()}"
    import sys

    from cluster import Proc
    c.router = Proc("router", [sys.executable, "-m", "baton.router", "--port", str(port), "--colocated", dead],
                    f"127.0.0.1:{port}")
    c.procs.append(c.router)
    c.router.start(c.env, tmp_path)
    try:
        c.router.wait_ready()
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            collect(c.stub(), router_pb2.GenerateRequest(text="hi", sampling=greedy(2)), timeout=20)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "no healthy" in err.value.details()
        assert time.monotonic() - t0 < 10
    finally:
        c.stop()
