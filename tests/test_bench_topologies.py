"""B2's topologies: any XpYd split or N colocated replicas of a host's devices, and the
recommended split per SLO pair, computed from the sweep's own numbers."""
from __future__ import annotations

import pytest

from baton.benchmarks import deployment
from baton.benchmarks.serve import parse_slos, recommend


@pytest.mark.parametrize("name,roles", [
    ("1p1d", ["prefill", "decode"]),
    ("1p3d", ["prefill", "decode", "decode", "decode"]),
    ("3p1d", ["prefill", "prefill", "prefill", "decode"]),
    ("4colocated", ["colocated"] * 4),
])
def test_a_topology_names_its_workers(name, roles):
    assert deployment.roles(name) == roles


@pytest.mark.parametrize("bad", ["0p1d", "1p0d", "2p", "colocated", "1p1d2", "0colocated", "p1d"])
def test_a_malformed_topology_is_refused_with_the_grammar(bad):
    with pytest.raises(ValueError, match="XpYd|at least one"):
        deployment.roles(bad)


def test_devices_are_handed_out_prefill_first_from_one_pool():
    pool = ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    assert deployment.plan("1p3d", pool) == [("prefill", "cuda:0"), ("decode", "cuda:1"), ("decode", "cuda:2"),
                                             ("decode", "cuda:3")]
    assert deployment.plan("3p1d", pool)[-1] == ("decode", "cuda:3")
    assert deployment.plan("2p2d", ["cpu"]) == [("prefill", "cpu"), ("prefill", "cpu"), ("decode", "cpu"),
                                                ("decode", "cpu")]


def test_the_recommendation_is_the_best_goodput_per_tpot_slo():
    def topo(workers: int, goodput: dict) -> dict:
        return {"deployment": {"workers": [{}] * workers}, "goodput_by_tpot_ms": goodput}
    topologies = {"1p3d": topo(4, {"15": 8.0, "25": 16.0, "50": None}),
                  "3p1d": topo(4, {"15": 4.0, "25": 24.0, "50": 32.0}),
                  "4colocated": topo(4, {"15": None, "25": 24.0, "50": 40.0})}
    rows = {r["tpot_ms"]: r for r in recommend(topologies, parse_slos("15,25,50,5"))}
    assert rows[15.0]["best"] == "1p3d" and rows[15.0]["goodput"] == 8.0
    assert rows[25.0]["best"] == "3p1d"                     # a tie goes to the first listed
    assert rows[50.0]["best"] == "4colocated" and rows[50.0]["by_topology"]["1p3d"] is None
    assert rows[5.0]["best"] is None and rows[5.0]["goodput"] is None


def test_slos_must_be_positive_milliseconds():
    assert parse_slos("10, 25") == [10.0, 25.0]
    with pytest.raises(ValueError, match="> 0"):
        parse_slos("25,0")
