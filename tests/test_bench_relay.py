"""`baton bench relay`: the synthetic core emits one token per request per step and ends each
at max_tokens; the smoke run (real worker fronts, cores, router and client processes) relays
every token of every stream and its figures add up. Timings are never asserted."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest
from cluster import REPO

from baton.benchmarks.synthetic_core import FALLBACK_IDS, SyntheticCore
from baton.engine.requests.sampling_params import SamplingParams
from baton.serving.grpc_server import ServiceError
from baton.serving.worker.core_protocol import Updates
from baton.serving.worker.worker_config import WorkerConfig


def test_synthetic_core_gives_every_request_one_token_per_step_until_max_tokens(monkeypatch):
    monkeypatch.setenv("BATON_SYNTHETIC_STEP_MS", "1")
    sent = []
    core = SyntheticCore(WorkerConfig(role="colocated"), sent.append)

    async def scenario():
        info = await core.start()
        await core.stop()                       # steps are driven by hand below
        await core.cmd_add("a", [1, 2, 3], SamplingParams(max_tokens=2), [])
        await core.cmd_add("b", [1], SamplingParams(max_tokens=3), [])
        with pytest.raises(ServiceError):
            await core.cmd_admit("c", [1], SamplingParams(), "grpc", 1.0)
        return info

    info = asyncio.run(scenario())
    assert info["tokenizer_dir"] is None and info["model"] == "smollm2-135m-instruct"
    for _ in range(3):
        core._step()
    steps = [m for m in sent if isinstance(m, Updates)]
    assert [[(u.request_id, u.finish_reason) for u in m.updates] for m in steps] == [
        [("a", None), ("b", None)], [("a", "length"), ("b", None)], [("b", "length")]]
    assert all(len(u.new_token_ids) == 1 and u.new_token_ids[0] in FALLBACK_IDS for m in steps for u in m.updates)
    assert core.stats().running == 0 and core.blocks_used == 0


@pytest.mark.slow
@pytest.mark.parametrize("api", ["grpc", "openai"])
def test_relay_smoke_relays_every_token_of_every_stream(tmp_path, api):
    """Through Router.Generate and through the router's OpenAI API (streamed /v1/completions)."""
    out = tmp_path / "relay.json"
    r = subprocess.run([sys.executable, "-m", "baton", "bench", "relay", "--smoke", "--api", api, "--output", str(out)],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "[bench] relay:" in r.stderr and f"through one router process ({api}," in r.stderr
    data = json.loads(out.read_text())
    assert data["benchmark"] == "relay" and data["git"] and data["device"]["type"] == "cpu"
    (level,) = data["results"]["levels"]
    assert level["api"] == api
    streams, tokens = level["streams"], level["max_tokens"]
    assert (streams, tokens, level["workers"], level["clients"]) == (40, 20, 2, 1)
    assert level["complete_streams"] == streams and level["errors"] == {}
    assert level["tokens"] == streams * tokens
    assert streams <= level["messages"] <= level["tokens"]          # at least one message per stream
    assert level["tok_s"] > 0 and level["wall_s"] > 0 and level["offered_tok_s"] == streams * 1000 / 5
    assert level["tokens_per_message"] == pytest.approx(level["tokens"] / level["messages"])
    assert level["tpot_ms"]["count"] == streams and level["router_cpu_s"] >= 0
