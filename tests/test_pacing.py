"""router/pacing.py: the message rate a router writes to its client streams follows its own CPU:
a busy event loop coalesces more tokens per message; an idle one goes back to a message a token."""
from __future__ import annotations

import pytest

from baton.router.pacing import MAX_INTERVAL_S, MIN_RATE, SAMPLE_S, MessagePacer


class Clocks:
    def __init__(self):
        self.wall = self.cpu = 0.0

    def run(self, seconds: float, busy: float) -> None:
        self.wall += seconds
        self.cpu += seconds * busy


def pacer(max_rate: float = 10_000.0) -> tuple[MessagePacer, Clocks]:
    c = Clocks()
    return MessagePacer(max_rate, clock=lambda: c.wall, cpu=lambda: c.cpu), c


def test_few_streams_are_not_paced_and_many_share_the_rate():
    p, _ = pacer()
    assert p.interval(10) == 0.0                        # 1 ms apart would buy nothing
    assert p.interval(190) == pytest.approx(0.019)      # 190 streams share 10,000 messages a second
    assert p.interval(5_000) == MAX_INTERVAL_S          # a message at least every 100 ms, whatever the count
    assert MessagePacer(0).interval(5_000) == 0.0       # --stream-message-rate 0: no pacing


def test_a_busy_router_sends_fewer_messages_until_it_has_room_then_more_again():
    p, c = pacer()
    rates = []
    for _ in range(8):                                  # the event loop's thread busy 95 % of the time
        c.run(SAMPLE_S, 0.95)
        p.interval(190)
        rates.append(p.rate)
    assert rates == sorted(rates, reverse=True) and rates[-1] < 1_000
    assert p.rate >= MIN_RATE and p.interval(190) == MAX_INTERVAL_S      # never below a message per 100 ms
    for _ in range(20):                                 # room again: back to the configured rate, not past it
        c.run(SAMPLE_S, 0.3)
        p.interval(190)
    assert p.rate == 10_000.0


def test_a_router_in_its_comfortable_band_keeps_its_rate():
    """The false positive: a router busy 50-80 % of the time (a loaded but keeping-up router, or a
    slow step now and then) is left alone, and a reading comes only every SAMPLE_S."""
    p, c = pacer()
    for busy in (0.6, 0.75, 0.55, 0.79, 0.5):
        c.run(SAMPLE_S, busy)
        p.interval(190)
    assert p.rate == 10_000.0
    c.run(SAMPLE_S / 4, 1.0)                            # a burst shorter than one reading: not read yet
    p.interval(190)
    assert p.rate == 10_000.0


def test_the_reading_stays_current_while_no_stream_is_relayed_and_is_exported():
    """The health checks' round reads the router's load too (RouterService._after_checks), so the
    gauge does not keep the last busy figure of a load that has ended; --stream-message-rate 0
    turns pacing off, not the reading."""
    from prometheus_client import generate_latest

    from baton.serving.metrics import Metrics
    p, c = pacer(0)
    c.run(SAMPLE_S, 0.9)
    p.sample()
    assert p.busy == pytest.approx(0.9) and p.interval(5_000) == 0.0
    c.run(SAMPLE_S, 0.1)
    p.sample()
    assert p.busy == pytest.approx(0.1)
    m = Metrics("router")
    m.watch_pacing(lambda: p.busy, lambda: p.rate)
    values = dict(line.rsplit(" ", 1) for line in generate_latest(m.registry).decode().splitlines()
                  if line.startswith("baton_router_"))
    assert float(values["baton_router_busy_ratio"]) == pytest.approx(0.1)
    assert float(values["baton_router_stream_message_rate"]) == 0.0
