"""The deployment files, checked by real validators with no engine or cluster: docker-compose.yml
by docker-compose 1.29 (`config`, every profile; its venv is the Makefile's .venv-compose), the
Kubernetes manifests by kubernetes-validate against the API's own schemas (strict: an unknown
field is an error). What they run is tested elsewhere: test_compose.py runs the compose stack."""
from __future__ import annotations

import importlib.util
import shutil
import subprocess

import jsonpatch
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


@pytest.mark.parametrize("profiles", [[], ["gpu"], ["npu"], ["cpu", "bench"], ["cpu", "observability"]])
def test_docker_compose_config_accepts_every_profile(profiles):
    flags = [x for p in profiles for x in ("--profile", p)]
    run = _compose(*flags, "config")
    assert run.returncode == 0, run.stderr
    services = yaml.safe_load(run.stdout)["services"]
    want = {"": {"prefill", "decode", "router"}, "gpu": {"prefill-gpu", "decode-gpu", "router-gpu"}}
    if profiles in ([], ["gpu"]):
        assert want[profiles[0] if profiles else ""] <= set(services)
    for svc in services.values():                  # what Docker will run, after interpolation
        if svc["image"].startswith("baton:"):
            assert svc["environment"]["BATON_MODEL"] == "smollm2-135m-instruct"


def test_the_observability_profile_scrapes_every_service_and_provisions_the_dashboard():
    run = _compose("--profile", "cpu", "--profile", "observability", "config")
    assert run.returncode == 0, run.stderr
    services = yaml.safe_load(run.stdout)["services"]
    # docker-compose 1.29 writes volumes short: SOURCE:TARGET:MODE, the source made absolute
    mounts = {name: {v.split(":")[1]: v.split(":")[0] for v in svc.get("volumes", []) if v.startswith("/")}
              for name, svc in services.items()}
    prometheus_yml = mounts["prometheus"]["/etc/prometheus/prometheus.yml"]
    jobs = {job["job_name"]: job["dns_sd_configs"][0] for job in yaml.safe_load(open(prometheus_yml))["scrape_configs"]}

    def flag(service: str, name: str) -> int:
        command = services[service]["command"]
        return int(command[command.index(name) + 1])
    # the router on its OpenAI port's /metrics, each worker on its --metrics-port, by compose service name
    assert jobs["baton-router"]["port"] == flag("router", "--http-port") and "router" in jobs["baton-router"]["names"]
    for role in ("prefill", "decode"):
        assert jobs[f"baton-{role}"]["port"] == flag(role, "--metrics-port") and role in jobs[f"baton-{role}"]["names"]
    provisioning = mounts["grafana"]["/etc/grafana/provisioning"]
    (source,) = yaml.safe_load(open(f"{provisioning}/datasources/prometheus.yaml"))["datasources"]
    assert source["url"] == "http://prometheus:9090" and "9090:9090" in [
        f"{p['published']}:{p['target']}" for p in services["prometheus"]["ports"]]
    (provider,) = yaml.safe_load(open(f"{provisioning}/dashboards/baton.yaml"))["providers"]
    dashboards = mounts["grafana"][provider["options"]["path"]]
    assert (REPO / "deploy" / "observability" / "grafana" / "dashboards" / "baton.json").samefile(
        f"{dashboards}/baton.json")


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
        assert "&id" not in text and "*id" not in text, "YAML anchors: every value is written out in full"
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
        assert c["args"][0] == role and "command" not in c          # the image's ENTRYPOINT, baton, runs
        assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] == 1000
        assert {"name": "hf-cache", "mountPath": GEN.HF_CACHE} in c["volumeMounts"]
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


def _base(profile: str) -> dict:
    return {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(GEN.render(profile)["baton.yaml"])}


@pytest.mark.parametrize("name", list(GEN.COMPONENTS))
def test_each_kustomize_component_validates_and_applies_to_every_profile(name):
    """A component's resources against the API schemas (a ServiceMonitor, a CRD with no schema here,
    against the Services it selects), and its patches applied (JSON 6902, as Kustomize applies them)
    to every profile's Deployments, the results validated again."""
    files = GEN.render_component(name)
    for file, text in files.items():
        assert (K8S / "components" / name / file).read_text() == text, "regenerate: python deploy/kubernetes/generate.py"
        assert "&id" not in text and "*id" not in text
    kustomization = yaml.safe_load(files["kustomization.yaml"])
    assert (kustomization["apiVersion"], kustomization["kind"]) == ("kustomize.config.k8s.io/v1alpha1", "Component")
    resources = list(yaml.safe_load_all(files["resources.yaml"])) if "resources" in kustomization else []
    assert bool(resources or kustomization.get("patches"))
    for profile in GEN.PROFILES:
        base = _base(profile)
        for doc in resources:
            if doc["kind"] == "ServiceMonitor":
                _check_service_monitor(doc, base)
                continue
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
            if doc["kind"] == "HorizontalPodAutoscaler":
                assert ("Deployment", doc["spec"]["scaleTargetRef"]["name"]) in base
            if doc["kind"] == "PodDisruptionBudget":
                selected = [d for (k, _), d in base.items() if k == "Deployment" and doc["spec"]["selector"][
                    "matchLabels"].items() <= d["spec"]["template"]["metadata"]["labels"].items()]
                assert len(selected) == 1, doc
        for p in kustomization.get("patches", []):
            target = base[(p["target"]["kind"], p["target"]["name"])]
            patched = jsonpatch.apply_patch(target, yaml.safe_load(p["patch"]))
            kubernetes_validate.validate(patched, K8S_VERSION, strict=True)
            pod = patched["spec"]["template"]["spec"]
            mounts = {m["mountPath"]: m["name"] for m in pod["containers"][0]["volumeMounts"]}
            volumes = {v["name"]: v for v in pod["volumes"]}
            if name == "shm":
                assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
            if name == "model-pvc":
                claim = volumes[mounts[GEN.HF_CACHE]]["persistentVolumeClaim"]["claimName"]
                assert claim == next(d["metadata"]["name"] for d in resources if d["kind"] == "PersistentVolumeClaim")


def _check_service_monitor(doc: dict, base: dict) -> None:
    assert doc["apiVersion"] == "monitoring.coreos.com/v1" and set(doc["spec"]) == {"selector", "endpoints"}
    services = [d for (k, _), d in base.items() if k == "Service"
                and doc["spec"]["selector"]["matchLabels"].items() <= d["metadata"]["labels"].items()]
    assert {s["metadata"]["name"] for s in services} == {"baton", "baton-prefill", "baton-decode"}
    for endpoint in doc["spec"]["endpoints"]:
        assert set(endpoint) <= {"port", "path", "interval"} and endpoint["path"] == "/metrics"
        for service in services:            # each Service names the port, and it leads to the pod's metrics port
            (port,) = [p for p in service["spec"]["ports"] if p["name"] == endpoint["port"]]
            assert port["targetPort"] == "metrics"
