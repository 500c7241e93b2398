"""What the deployment files pass to `baton` is what the CLI takes: every Kubernetes container's args
(test_compose.py does the same for docker-compose.yml's serving services) and the compose bench
client's command, parsed by the real parsers. A flag renamed in the CLI fails here, not in a cluster."""
from __future__ import annotations

import pytest
import yaml
from cluster import REPO
from test_compose import SERVICES, _parser_accepts

K8S = REPO / "deploy" / "kubernetes"


def _containers():
    for path in sorted(K8S.glob("*/baton.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            for c in (doc or {}).get("spec", {}).get("template", {}).get("spec", {}).get("containers", []):
                yield pytest.param(c["args"], id=f"{path.parent.name}-{doc['metadata']['name']}")


@pytest.mark.parametrize("args", list(_containers()))
def test_every_kubernetes_container_args_parse_with_the_real_cli(args):
    _parser_accepts(args)


def test_the_compose_bench_client_command_parses_with_the_real_cli():
    from baton.benchmarks.cli import BENCHMARKS, build_parser
    command = SERVICES["bench"]["command"]
    assert command[0] == "bench" and command[1] in BENCHMARKS
    args = build_parser(command[1]).parse_args(command[1:])
    assert args.benchmark == command[1] and args.addr == "router:50051"
