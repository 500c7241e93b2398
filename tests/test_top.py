"""`baton top` (baton/top.py): one frame from two scrapes of a router's merged /metrics, or of several
routers' (summed; a router down is shown, not summed around), and the command against live HTTP
targets."""
from __future__ import annotations

import http.server
import io
import json
import subprocess
import sys
import threading

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from baton.benchmarks.prometheus import merge_routers
from baton.router import worker_metrics
from baton.serving.metrics import Metrics
from baton.top import Interval, Scrape, histogram_quantile, parse, render


class Worker:
    def __init__(self, address, role):
        self.address, self.role = address, role


def deployment():
    router, prefill, decode = Metrics("router"), Metrics("prefill"), Metrics("decode")
    for m in (router, prefill, decode):
        m.serving_model("m")
    return router, prefill, decode


def merged(router, prefill, decode) -> str:
    return worker_metrics.merge(generate_latest(router.registry),
                                [(Worker("p:1", "prefill"), generate_latest(prefill.registry).decode()),
                                 (Worker("d:1", "decode"), generate_latest(decode.registry).decode())]).decode()


def busy(router, prefill, decode) -> None:
    """Four requests finish in one second: 400 prompt and 40 output tokens, known stage times."""
    for _ in range(4):
        router.requests.labels("m", "length").inc()
        router.ttft.labels("m").observe(0.08)
        for _ in range(9):
            router.itl.labels("m").observe(0.02)
        for stage, s in (("queue", 0.001), ("admit", 0.002), ("prefill", 0.05), ("handover", 0.004),
                         ("decode", 0.3)):
            router.stage_seconds.labels("m", stage).observe(s)
    router.prompt_tokens.labels("m").inc(400)
    router.generation_tokens.labels("m").inc(40)
    prefill.kv_transfer_bytes.labels("out").inc(8e6)
    decode.kv_transfer_bytes.labels("in").inc(8e6)
    decode.running.set(3)
    decode.kv_usage.set(0.25)


def frame(before: str, after: str, health: dict) -> str:
    return show(Interval(Scrape(0.0, parse(before), {}), Scrape(1.0, parse(after), health)))


def show(iv: Interval) -> str:
    console = Console(record=True, width=200, file=io.StringIO())
    console.print(render(iv, "http://h:8000/metrics"))
    return console.export_text()


def test_a_frame_shows_the_rates_the_stages_and_every_worker():
    router, prefill, decode = deployment()
    before = merged(router, prefill, decode)
    busy(router, prefill, decode)
    text = frame(before, merged(router, prefill, decode), {"status": "ok"})
    assert "status ok" in text
    rows = {line.split()[0]: line.split() for line in text.splitlines() if line.split()}
    assert rows["p:1"] == ["p:1", "prefill", "0", "0", "0%", "-", "/", "-", "0.0", "8.0"]
    assert rows["d:1"] == ["d:1", "decode", "3", "0", "25%", "-", "/", "-", "8.0", "0.0"]   # KV MB/s in, out
    (requests,) = [r for r in rows.values() if r[:3] == ["0", "0", "4.0"]]
    assert requests[3:6] == ["0.0", "400", "40.0"]           # errors/s, prompt and output tokens a second
    stages = {r[0]: r[1] for r in rows.values() if r[0] in ("queue", "admit", "prefill", "handover", "decode")}
    assert stages == {"queue": "1.0", "admit": "2.0", "prefill": "50.0", "handover": "4.0", "decode": "300"}


def test_a_degraded_deployment_and_a_target_without_workers_say_so():
    router, _, _ = deployment()
    text = generate_latest(router.registry).decode()
    shown = frame(text, text, {"status": "degraded", "reason": "not disaggregating: no healthy prefill"})
    assert "status degraded (not disaggregating: no healthy prefill)" in shown
    assert "no worker series here" in shown and "no request finished in this interval" in shown


def test_histogram_quantile_interpolates_as_prometheus_does():
    buckets = {1.0: 1, 2.0: 3, float("inf"): 4}
    assert histogram_quantile(0.5, buckets) == 1.5 and histogram_quantile(0.99, buckets) == 2.0
    assert histogram_quantile(0.5, {float("inf"): 0}) is None


def test_the_command_reads_a_live_target_once():
    router, prefill, decode = deployment()
    pages = [merged(router, prefill, decode)]
    busy(router, prefill, decode)
    pages.append(merged(router, prefill, decode))

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = (json.dumps({"status": "ok"}) if self.path == "/health" else
                    pages.pop(0) if len(pages) > 1 else pages[0]).encode()
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        out = subprocess.run([sys.executable, "-m", "baton", "top", "--url", url, "--once", "--interval", "0.2"],
                             capture_output=True, text=True, timeout=60)
        # into a pipe (not a terminal): a frame every interval, each written as it is made (as `top -b` does)
        watch = subprocess.Popen([sys.executable, "-m", "baton", "top", "--url", url, "--interval", "0.2"],
                                 stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        frames = []

        def read():
            for line in watch.stdout:
                if "status ok" in line:
                    frames.append(line)
                    if len(frames) == 2:
                        return
        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(timeout=30)
        watch.kill()
        watch.wait(timeout=30)
        assert len(frames) == 2, "no frame reached the pipe while baton top ran"
    finally:
        server.shutdown()
    assert out.returncode == 0, out.stderr
    assert "status ok" in out.stdout and "d:1" in out.stdout and "p:1" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "baton", "top", "--url", "http://127.0.0.1:1/metrics", "--once"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "is the router up" in bad.stderr


def routers_scrape(at: float, texts: list[str], down: tuple[str, ...] = ()) -> Scrape:
    fams = [list(text_string_to_metric_families(t)) for t in texts]
    return Scrape(at, merge_routers(fams, apart=True), {}, len(texts) + len(down), down)


def test_two_routers_add_up_even_when_one_is_idle_and_a_down_one_is_shown():
    a, prefill, decode = deployment()
    b = Metrics("router")
    b.serving_model("m")
    for _ in range(3):                     # b served before; in this second only a does
        b.requests.labels("m", "stop").inc()
    before = [merged(a, prefill, decode), generate_latest(b.registry).decode()]
    busy(a, prefill, decode)
    after = [merged(a, prefill, decode), generate_latest(b.registry).decode()]
    text = show(Interval(routers_scrape(0.0, before), routers_scrape(1.0, after)))
    assert "2 of 2 routers" in text and "router down" not in text and "not shown" not in text
    rows = {line.split()[0]: line.split() for line in text.splitlines() if line.split()}
    (requests,) = [r for r in rows.values() if r[:3] == ["0", "0", "4.0"]]      # a's 4 a second, b's none
    assert requests[3:6] == ["0.0", "400", "40.0"]
    assert rows["d:1"][:5] == ["d:1", "decode", "3", "0", "25%"]
    b.requests.labels("m", "stop").inc(50)
    text = show(Interval(routers_scrape(0.0, before[:1], ("http://r1/metrics (Connection refused)",)),
                         routers_scrape(1.0, after)))
    assert "1 of 2 routers" in text and "router down: http://r1/metrics (Connection refused)" in text
    assert "not shown while a router does not answer" in text and "400" not in text      # no partial rates
    assert "d:1" in text                                  # the workers' series: from the router that answered


def test_the_command_sums_every_router_and_names_the_one_down(canned_routers):
    a, b = Metrics("router"), Metrics("router")
    pages = [generate_latest(a.registry).decode()]
    a.requests.labels("m", "stop").inc(4)
    pages.append(generate_latest(a.registry).decode())
    urls = [canned_routers(pages), canned_routers([generate_latest(b.registry).decode()])]
    out = subprocess.run([sys.executable, "-m", "baton", "top", "--metrics-url", ",".join(urls), "--once",
                          "--interval", "0.2"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "2 of 2 routers" in out.stdout and "router down" not in out.stdout
    assert "these routers run without --worker-metrics" in out.stdout     # canned pages with no worker series
    assert "status ok" in " ".join(out.stdout.split())    # no /health on a metrics port: their baton_degraded says
    b.degraded.set(1)
    urls[1] = canned_routers([generate_latest(b.registry).decode()])
    out = subprocess.run([sys.executable, "-m", "baton", "top", "--metrics-url", ",".join(urls), "--once",
                          "--interval", "0.2"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "status degraded" in " ".join(out.stdout.split()), out.stdout
    out = subprocess.run([sys.executable, "-m", "baton", "top", "--metrics-url", f"{urls[1]},{canned_routers.DOWN}",
                          "--once", "--interval", "0.2"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert f"router down: {canned_routers.DOWN} (" in out.stdout and "not shown while" in out.stdout
