"""The deployment files, checked by real validators with no engine or cluster: docker-compose.yml
by docker-compose 1.29 (`config`, every profile; its venv is the Makefile's .venv-compose), the
Kubernetes manifests by kubernetes-validate against the API's own schemas (strict: an unknown
field is an error). What they run is tested elsewhere: test_compose.py runs the compose stack."""
from __future__ import annotations

import importlib.util
import shutil
import subprocess

import kubernetes_validate
import pytest
import yaml
from cluster import REPO

COMPOSE = REPO / ".venv-compose" / "bin" / "docker-compose"
K8S = REPO / "deploy" / "kubernetes"
K8S_VERSION = "1.30.0"       # gRPC probes are GA from 1.27; the oldest minor still commonly run


def _compose(*args: str, cwd=REPO) -> subprocess.CompletedProcess:
    assert COMPOSE.exists(), "make .venv-compose/.installed (the test target does) installs docker-compose"
    return subprocess.run([str(COMPOSE), *args], cwd=cwd, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("profiles", [[], ["gpu"], ["npu"], ["cpu", "bench"]])
def test_docker_compose_config_accepts_every_profile(profiles):
    flags = [x for p in profiles for x in ("--profile", p)]
    run = _compose(*flags, "config")
    assert run.returncode == 0, run.stderr
    services = yaml.safe_load(run.stdout)["services"]
    want = {"": {"prefill", "decode", "router"}, "gpu": {"prefill-gpu", "decode-gpu", "router-gpu"}}
    if profiles in ([], ["gpu"]):
        assert want[profiles[0] if profiles else ""] <= set(services)
    for svc in services.values():                  # what Docker will run, after interpolation
        assert svc["environment"]["BATON_MODEL"] == "smollm2-135m-instruct"


def test_docker_compose_config_rejects_a_broken_file(tmp_path):
    """The validator validates: the same file with one wrong value is refused."""
    shutil.copy(REPO / ".env", tmp_path / ".env")
    text = (REPO / "docker-compose.yml").read_text().replace("condition: service_healthy", "condition: when_ready", 1)
    (tmp_path / "docker-compose.yml").write_text(text)
    run = _compose("config", "-q", cwd=tmp_path)
    assert run.returncode != 0 and "when_ready" in run.stderr, run.stderr


def _generator():
    spec = importlib.util.spec_from_file_location("k8s_generate", K8S / "generate.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


GEN = _generator()


@pytest.mark.parametrize("profile", list(GEN.PROFILES))
def test_kubernetes_manifests_validate_and_are_generated(profile):
    files = GEN.render(profile)
    for name, text in files.items():
        assert (K8S / profile / name).read_text() == text, "regenerate: python deploy/kubernetes/generate.py"
    kustomization = yaml.safe_load(files["kustomization.yaml"])
    assert kustomization["resources"] == ["baton.yaml"]
    docs = list(yaml.safe_load_all(files["baton.yaml"]))
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    kinds = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    headless = {n for (k, n), d in kinds.items() if k == "Service" and d["spec"].get("clusterIP") == "None"}
    assert headless == {"baton-prefill", "baton-decode"}
    for role in ("router", "prefill", "decode"):
        pod = kinds[("Deployment", f"baton-{role}")]["spec"]["template"]["spec"]
        (c,) = pod["containers"]
        assert pod["restartPolicy"] == "Always" and pod["terminationGracePeriodSeconds"] > 30     # > --grace
        assert "grpc" in c["readinessProbe"] and "grpc" in c["startupProbe"] and "livenessProbe" in c
        if role == "router":                       # the worker sets it re-resolves are the headless names
            targets = {c["args"][c["args"].index(f) + 1].split(":")[0] for f in ("--prefill", "--decode")}
            assert targets == headless
        else:
            accelerators = set(c["resources"]["limits"]) - {"memory", "cpu"}
            assert accelerators == {"cpu": set(), "nvidia": {"nvidia.com/gpu"},
                                    "ascend": {"huawei.com/Ascend910"}}[profile]
            env = {e["name"] for e in c["env"]}
            assert {"BATON_ADVERTISE_HOST", "BATON_KV_SECRET"} <= env
    with pytest.raises(kubernetes_validate.ValidationError):     # the validator validates
        bad = kinds[("Deployment", "baton-decode")]
        bad["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "grpc-port"
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)
