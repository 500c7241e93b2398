"""TLS everywhere, bearer tokens and limits, on a real cluster with certificates made here.

Workers serve mutual TLS (only peers with a certificate from our CA get in: the router, and
prefill workers pushing KV to decode workers) and KV peers must also prove a shared secret; the router serves TLS to the public with
bearer tokens naming clients, per-client concurrency limits and prompt/max_tokens limits.
"""
from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import grpc
import pytest
from certs import CA
from cluster import REPO, Cluster
from grpc_health.v1 import health_pb2, health_pb2_grpc
from reliability import Outcomes, stream_ids

from baton.engine import SamplingParams
from baton.kvtransfer.backend import KVTransferError
from baton.kvtransfer.grpc_backend import GrpcKVSender
from baton.kvtransfer.grpc_options import channel_options
from baton.kvtransfer.layout import KVLayout
from baton.kvtransfer.peer_auth import KVPeerAuth
from baton.serving.grpc_server import open_channel, retry_after_ms
from baton.serving.security import TLSConfig
from baton.v1 import router_pb2, router_pb2_grpc

pytestmark = pytest.mark.timeout(600)

ALICE = "alice-token-0123456789abcdef"
BOB = "bob-token-0123456789abcdef01"
KV_SECRET = "kv-secret-for-this-test-0123456789"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    ca = CA(d, "baton-ca")
    rogue = CA(d, "rogue-ca")
    tokens = d / "tokens"
    tokens.write_text(f"# client:token\nalice:{ALICE}\nbob:{BOB}\n")
    return {"ca": ca.path, "node": ca.issue("node"), "client": ca.issue("client"), "rogue_ca": rogue.path,
            "rogue": rogue.issue("rogue-node"), "tokens": str(tokens)}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, pki):
    cert, key = pki["node"]
    env = {"BATON_TLS_CERT": cert, "BATON_TLS_KEY": key, "BATON_TLS_CA": pki["ca"], "BATON_KV_SECRET": KV_SECRET}
    c = Cluster.launch(tmp_path_factory.mktemp("logs"), prefill=1, decode=1, env=env,
                       worker_args=["--num-kv-blocks", "128", "--tls-require-client-cert"],
                       router_args=["--auth-token-file", pki["tokens"], "--max-per-client", "2",
                                    "--max-prompt-tokens", "64", "--max-new-tokens", "48"],
                       tls=TLSConfig(cert=cert, key=key, ca=pki["ca"]))
    yield c
    c.stop()


def public_channel(cluster, pki, root: str | None = None) -> grpc.Channel:
    return grpc.secure_channel(cluster.router.address,
                               grpc.ssl_channel_credentials(root_certificates=open(root or pki["ca"], "rb").read()))


def auth(token: str):
    return [("authorization", f"Bearer {token}")]


def greedy(n: int) -> router_pb2.SamplingParams:
    return router_pb2.SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def test_greedy_tokens_over_tls_match_the_offline_engine(cluster, pki, embedded_llm):
    """Client -> router (TLS, token), router -> workers (mTLS), prefill -> decode KV (mTLS)."""
    prompts = ["The quick brown fox", "def quicksort(arr):"]
    want = embedded_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    with public_channel(cluster, pki) as ch:
        stub = router_pb2_grpc.RouterStub(ch)
        for p, w in zip(prompts, want, strict=True):
            assert stream_ids(stub, router_pb2.GenerateRequest(text=p, sampling=greedy(8)), 60, auth(ALICE)) == \
                w.token_ids


def _code(fn) -> grpc.StatusCode | None:
    try:
        fn()
    except grpc.RpcError as exc:
        return exc.code()
    return None


def _kv_handshake(address: str, llm, tls: TLSConfig, secret: bytes | None) -> grpc.StatusCode | None:
    """Handshake with a decode worker's KV service as a prefill worker would; None if accepted."""
    m = llm.runner.model
    layout = KVLayout(model=llm.source.name, architecture=llm.source.architecture,
                      dtype=str(llm.runner.dtype).removeprefix("torch."), block_size=llm.config.block_size,
                      num_layers=m.num_layers, num_kv_heads=m.num_kv_heads, head_dim=m.head_dim)

    async def main():
        sender = GrpcKVSender(open_channel(address, tls, options=channel_options()),
                              auth=KVPeerAuth(secret) if secret else None)
        try:
            await sender.handshake(layout)
        except KVTransferError as exc:
            return exc.code
        finally:
            await sender.channel.close()
    return asyncio.run(main())


def test_bad_credentials_are_refused(cluster, pki, reliability, embedded_llm):
    req = router_pb2.GenerateRequest(text="hi", sampling=greedy(2))
    cert, key = pki["client"]
    rogue_cert, rogue_key = pki["rogue"]
    worker = cluster.worker("decode-0").address
    refused = {}
    with public_channel(cluster, pki) as ch:
        stub = router_pb2_grpc.RouterStub(ch)
        refused["no token"] = _code(lambda: stream_ids(stub, req, 10))
        refused["wrong token"] = _code(lambda: stream_ids(stub, req, 10, auth("x" * 32)))
        refused["not a bearer header"] = _code(lambda: stream_ids(stub, req, 10, [("authorization", ALICE)]))
        refused["token on GetModelInfo too"] = _code(
            lambda: stub.GetModelInfo(router_pb2.GetModelInfoRequest(), timeout=10))
        # health stays open (orchestrators probe it) but says nothing about the model
        assert health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status == \
            health_pb2.HealthCheckResponse.SERVING
    with grpc.insecure_channel(cluster.router.address) as ch:
        refused["plaintext to the TLS router"] = _code(
            lambda: stream_ids(router_pb2_grpc.RouterStub(ch), req, 10, auth(ALICE)))
    with public_channel(cluster, pki, root=pki["rogue_ca"]) as ch:
        refused["router cert not from the trusted CA"] = _code(
            lambda: stream_ids(router_pb2_grpc.RouterStub(ch), req, 10, auth(ALICE)))

    def worker_health(credentials) -> None:
        with grpc.secure_channel(worker, credentials) as ch:
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
    ca = open(pki["ca"], "rb").read()
    refused["worker: no client cert"] = _code(lambda: worker_health(grpc.ssl_channel_credentials(ca)))
    refused["worker: client cert from a rogue CA"] = _code(lambda: worker_health(grpc.ssl_channel_credentials(
        ca, open(rogue_key, "rb").read(), open(rogue_cert, "rb").read())))
    with grpc.insecure_channel(worker) as ch:
        refused["worker: plaintext"] = _code(
            lambda: health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10))
    assert _code(lambda: worker_health(grpc.ssl_channel_credentials(
        ca, open(key, "rb").read(), open(cert, "rb").read()))) is None          # the right cert gets in
    # a host with a good certificate but not the KV secret cannot become a KV peer
    node = TLSConfig(cert=cert, key=key, ca=pki["ca"])
    kv = cluster.worker("decode-0").status(tls=node).kv_address        # its engine core's KV port
    for name, secret in [("KV handshake: right cert, no secret", None),
                         ("KV handshake: right cert, wrong secret", b"not-the-kv-secret-0123456789")]:
        refused[name] = _kv_handshake(kv, embedded_llm.engine, node, secret)
    assert _kv_handshake(kv, embedded_llm.engine, node, KV_SECRET.encode()) is None
    unauth = {"no token", "wrong token", "not a bearer header", "token on GetModelInfo too",
              "KV handshake: right cert, no secret", "KV handshake: right cert, wrong secret"}
    for name, code in refused.items():
        want = grpc.StatusCode.UNAUTHENTICATED if name in unauth else grpc.StatusCode.UNAVAILABLE
        assert code == want, (name, code)
    leaked = cluster.wait_workers_idle()
    reliability.record("security: bad credentials", None, bad_inputs_tried=len(refused),
                       rejected=sum(c is not None for c in refused.values()), leaked_blocks=leaked)
    assert leaked == 0


def test_per_client_concurrency_limit(cluster, pki, reliability):
    with public_channel(cluster, pki) as ch:
        stub = router_pb2_grpc.RouterStub(ch)
        long = [stub.Generate(router_pb2.GenerateRequest(text=f"Story {i}:", sampling=greedy(48)), timeout=60,
                              metadata=auth(ALICE)) for i in range(2)]
        for it in long:
            next(it)                                   # both running
        with pytest.raises(grpc.RpcError) as err:
            stream_ids(stub, router_pb2.GenerateRequest(text="third", sampling=greedy(2)), 10, auth(ALICE))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "alice" in err.value.details() and retry_after_ms(err.value.trailing_metadata()) > 0
        assert len(stream_ids(stub, router_pb2.GenerateRequest(text="bob", sampling=greedy(2)), 30, auth(BOB))) == 2
        for it in long:
            it.cancel()
    out = Outcomes()
    out.add(err.value, None, 0, 10)
    leaked = cluster.wait_workers_idle()
    reliability.record("limit: concurrent requests per client", out, limit=2, leaked_blocks=leaked)
    assert leaked == 0


@pytest.mark.parametrize("fields, fragment", [
    (dict(tokens=router_pb2.TokenIds(ids=[5] * 65)), "at most 64"),
    (dict(text="hi", sampling=router_pb2.SamplingParams(max_tokens=49)), "limit of 48"),
])
def test_configured_limits_are_invalid_argument(cluster, pki, fields, fragment, reliability):
    with public_channel(cluster, pki) as ch:
        with pytest.raises(grpc.RpcError) as err:
            stream_ids(router_pb2_grpc.RouterStub(ch), router_pb2.GenerateRequest(**fields), 10, auth(BOB))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and fragment in err.value.details()
    out = Outcomes()
    out.add(err.value, None, 0, 10)
    leaked = cluster.wait_workers_idle()
    reliability.record(f"limit: {fragment.replace('at most', 'prompt tokens at most').replace('limit of', 'max_tokens limit')}",
                       out, leaked_blocks=leaked)
    assert leaked == 0


def test_the_cli_client_speaks_tls_with_a_token(cluster, pki):
    t0 = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "baton", "generate", "--addr", cluster.router.address,
                          "--tls-ca", pki["ca"], "--token", BOB, "--max-tokens", "4", "--raw", "Hello"],
                         cwd=REPO, capture_output=True, text=True, timeout=120, env=cluster.env)
    assert run.returncode == 0, run.stderr
    assert "completion 4" in run.stderr, (run.stderr, time.monotonic() - t0)
    denied = subprocess.run([sys.executable, "-m", "baton", "generate", "--addr", cluster.router.address,
                             "--tls-ca", pki["ca"], "--raw", "Hello"],
                            cwd=REPO, capture_output=True, text=True, timeout=120, env=cluster.env)
    assert denied.returncode == 1 and "BATON_AUTH_TOKEN" in denied.stderr


def test_only_the_owner_may_abort_a_request(cluster, pki):
    """With tokens on, another client's Abort finds nothing (and learns nothing); the owner's works."""
    with public_channel(cluster, pki) as ch:
        stub = router_pb2_grpc.RouterStub(ch)
        it = stub.Generate(router_pb2.GenerateRequest(request_id="alices-story", text="Story:", sampling=greedy(48)),
                           timeout=60, metadata=auth(ALICE))
        next(it)
        refused = stub.Abort(router_pb2.AbortRequest(request_id="alices-story"), timeout=10, metadata=auth(BOB))
        assert not refused.found
        next(it)                                       # still streaming to alice
        assert stub.Abort(router_pb2.AbortRequest(request_id="alices-story"), timeout=10, metadata=auth(ALICE)).found
        with pytest.raises(grpc.RpcError) as err:
            for _ in it:
                pass
        assert err.value.code() == grpc.StatusCode.CANCELLED
    assert cluster.wait_workers_idle() == 0
