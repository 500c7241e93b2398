"""Fuzzing the public API with hypothesis against the real router and workers: whatever a
client sends, the answer is a status a client can act on (never INTERNAL or UNKNOWN), the
servers stay up, and correct requests running beside the junk keep their exact answers."""
from __future__ import annotations

import collections

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reliability import Outcomes, stream_ids

from baton.engine import SamplingParams
from baton.v1 import router_pb2

pytestmark = pytest.mark.timeout(600)

ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.DEADLINE_EXCEEDED,
           grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.RESOURCE_EXHAUSTED}
CALL_TIMEOUT_S = 2.5
floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=32), st.floats(0, 2, width=32))
texts = st.text(max_size=200)


@st.composite
def requests(draw) -> router_pb2.GenerateRequest:
    req = router_pb2.GenerateRequest(request_id=draw(st.one_of(st.just(""), st.text(max_size=140))))
    kind = draw(st.sampled_from(["text", "tokens", "chat", "none"]))
    if kind == "text":
        req.text = draw(texts)
    elif kind == "tokens":
        req.tokens.ids.extend(draw(st.lists(st.one_of(st.integers(0, 49151), st.integers(0, 2**32 - 1)),
                                            max_size=64)))
    elif kind == "chat":
        for role, content in draw(st.lists(st.tuples(st.sampled_from(["user", "assistant", "system", "", "root"]),
                                                     texts), max_size=4)):
            req.chat.messages.add(role=role, content=content)
    s = req.sampling
    if draw(st.booleans()):
        s.temperature = draw(floats)
    if draw(st.booleans()):
        s.top_p = draw(floats)
    if draw(st.booleans()):
        s.top_k = draw(st.integers(-2**31, 2**31 - 1))
    if draw(st.booleans()):         # mostly short; huge ones run into the call's deadline
        s.max_tokens = draw(st.one_of(st.integers(0, 3), st.integers(0, 3), st.integers(0, 3),
                                      st.integers(0, 2**32 - 1)))
    else:
        s.max_tokens = 2
    s.stop.extend(draw(st.lists(st.text(max_size=8), max_size=20)))
    s.stop_token_ids.extend(draw(st.lists(st.integers(0, 2**32 - 1), max_size=4)))
    s.ignore_eos = draw(st.booleans())
    if draw(st.booleans()):
        s.seed = draw(st.integers(0, 2**64 - 1))
    return req


def test_fuzzed_router_requests_get_actionable_statuses(pd_cluster, embedded_llm, reliability):
    stub = pd_cluster.stub()
    seen: collections.Counter = collections.Counter()

    @settings(max_examples=80, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(req=requests())
    def one(req):
        try:
            stream_ids(stub, req, CALL_TIMEOUT_S)
            code = grpc.StatusCode.OK
        except grpc.RpcError as exc:
            code = exc.code()
            assert "internal error" not in (exc.details() or "")
        seen[code.name] += 1
        assert code in ALLOWED, (code, req)

    one()
    # the servers are up, answer exactly, and hold nothing
    want = embedded_llm.generate(["The quick brown fox"], SamplingParams(temperature=0, max_tokens=6,
                                                                         ignore_eos=True))[0].token_ids
    greedy = router_pb2.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    assert stream_ids(stub, router_pb2.GenerateRequest(text="The quick brown fox", sampling=greedy), 60) == want
    leaked = pd_cluster.wait_workers_idle(30)
    out = Outcomes(sent=sum(seen.values()), completed=seen["OK"],
                   statuses=collections.Counter({k: v for k, v in seen.items() if k != "OK"}))
    reliability.record("fuzz: router requests (hypothesis)", out, leaked_blocks=leaked,
                       bad_inputs_tried=sum(v for k, v in seen.items() if k != "OK"))
    assert leaked == 0
