"""How the router's worker sets follow DNS (router/registry.py); the end-to-end scale-up and
scale-down under load is in test_compose.py."""
from __future__ import annotations

import asyncio
import socket

import pytest

from baton.router import registry as reg
from baton.router.config import parse_router_args


def test_targets_resolve_to_one_worker_per_address():
    assert asyncio.run(reg.resolve_target("10.0.0.7:50061")) == ["10.0.0.7:50061"]
    assert asyncio.run(reg.resolve_target("[::1]:50061")) == ["[::1]:50061"]
    assert asyncio.run(reg.resolve_target("localhost:50061")) == ["127.0.0.1:50061"]   # not ::1 as well
    with pytest.raises(socket.gaierror):
        asyncio.run(reg.resolve_target("no-such-host.invalid:1"))


@pytest.mark.parametrize("bad", ["decode", "decode:", "decode:http", "decode:70000", ":50061"])
def test_a_target_that_is_not_host_port_is_refused_at_start(bad):
    with pytest.raises(SystemExit):
        parse_router_args(["--prefill", "prefill:50071", "--decode", bad])


def test_workers_join_leave_and_survive_a_dns_failure(monkeypatch):
    answers = {"decode:50061": ["10.0.0.2:50061"]}

    async def fake_resolve(target):
        found = answers[target]
        if isinstance(found, Exception):
            raise found
        return found
    monkeypatch.setattr(reg, "resolve_target", fake_resolve)

    async def scenario():
        r = reg.Registry([], [], ["decode:50061"], "m")
        await r.resolve()
        assert [(w.address, w.target) for w in r.workers] == [("10.0.0.2:50061", "decode:50061")]
        answers["decode:50061"] = ["10.0.0.2:50061", "10.0.0.3:50061"]        # scaled up
        await r.resolve()
        assert [w.address for w in r.workers] == ["10.0.0.2:50061", "10.0.0.3:50061"]
        for w in r.workers:
            w.healthy = True
        answers["decode:50061"] = socket.gaierror("temporary failure")          # DNS hiccup: nothing drains
        await r.resolve()
        assert len(r.healthy("colocated")) == 2
        answers["decode:50061"] = ["10.0.0.3:50061"]                            # scaled down
        first = r.workers[0]
        first.inflight = 1                                                      # a stream still running on it
        await r.resolve()
        assert [w.address for w in r.healthy("colocated")] == ["10.0.0.3:50061"] and first in r.workers
        await r._close_idle_retired()
        assert first in r.workers                                               # kept until the stream ends
        first.inflight = 0
        await r._close_idle_retired()
        assert [w.address for w in r.workers] == ["10.0.0.3:50061"]
        await r.stop()
    asyncio.run(scenario())


def _router_log(tmp_path, *flags: str) -> list[str]:
    """A router whose decode name does not resolve, started and stopped: its stderr lines."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from baton.serving.processes import free_port
    port = free_port()
    log = tmp_path / f"router{len(flags)}.log"
    with open(log, "wb") as err:
        p = subprocess.Popen([sys.executable, "-m", "baton.router", "--port", str(port), "--prefill", "127.0.0.1:1",
                              "--decode", "no-such-decode.invalid:50061", *flags],
                             stderr=err, stdout=subprocess.DEVNULL, env=dict(os.environ, BATON_HTTP_PORT="0"))
        deadline = time.monotonic() + 60
        while "ready on" not in log.read_text() and time.monotonic() < deadline and p.poll() is None:
            time.sleep(0.2)
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=30)
    return [line for line in log.read_text().splitlines() if line.strip()]


def test_json_logs_are_one_object_per_line_and_the_level_filters(tmp_path):
    import json
    lines = _router_log(tmp_path, "--log-format", "json")
    records = [json.loads(line) for line in lines]                 # every line, progress lines included
    assert all({"time", "level", "logger", "message"} <= r.keys() for r in records)
    assert any(r["logger"] == "baton.router" and r["level"] == "WARNING" and "cannot resolve" in r["message"]
               for r in records), records
    assert any(r["logger"] == "baton" and r["message"].startswith("router ready on") for r in records), records
    quiet = _router_log(tmp_path, "--log-format", "json", "--log-level", "error")
    assert not any("cannot resolve" in line for line in quiet) and any("ready on" in line for line in quiet)
