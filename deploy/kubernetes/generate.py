"""Writes the Kubernetes manifests of each accelerator profile: deploy/kubernetes/<profile>/.

    python deploy/kubernetes/generate.py          # after editing this file; a test keeps them in step

One source, three plain-YAML directories (cpu, nvidia, ascend): `kubectl apply -k DIR` (or
`-f DIR/baton.yaml`) needs no Helm or Kustomize install, the YAML a reviewer reads is the YAML
the cluster gets, and the profiles cannot drift apart. Each directory is also a Kustomize base
for a site's own overlay (image registry, namespace, replicas, TLS), which can add the Kustomize
components of components/: servicemonitor (Prometheus Operator), hpa (decode and prefill workers
scaled on waiting requests and KV usage), pdb, shm (a memory-backed /dev/shm for the workers),
model-pvc (the HF cache on a shared volume instead of each pod's own).
"""
from __future__ import annotations

import sys
from pathlib import Path

import yaml

HERE = Path(__file__).parent
PORTS = {"router": 50051, "prefill": 50071, "decode": 50061}
KV_PORT = 50062                 # a decode worker's engine core takes KV pushes here (pod IP to pod IP)
HF_CACHE = "/var/cache/huggingface"     # the images' HF_HOME: Hub models are downloaded here
ROLES = ("prefill", "decode", "router")
METRICS = {"router": 9051, "prefill": 9071, "decode": 9061}
HTTP_PORT = 8000

PROFILES = {
    # image, the flags a worker adds, what each worker pod requests (one accelerator each)
    "cpu": {"image": "baton:cpu", "device": ["--device", "cpu"],
            "worker": {"requests": {"cpu": "2", "memory": "3Gi"}, "limits": {"memory": "4Gi"}}},
    "nvidia": {"image": "baton:cuda", "device": ["--device", "cuda:0"],
               "worker": {"requests": {"cpu": "4", "memory": "16Gi"},
                          "limits": {"memory": "32Gi", "nvidia.com/gpu": "1"}}},
    # the Ascend Device Plugin's resource; Ascend Docker Runtime mounts the NPU and its driver
    "ascend": {"image": "baton:ascend", "device": ["--device", "npu:0", "--block-size", "128"],
               "worker": {"requests": {"cpu": "4", "memory": "16Gi"},
                          "limits": {"memory": "32Gi", "huawei.com/Ascend910": "1"}}},
}


class NoAliases(yaml.SafeDumper):
    """Every value written out in full: no `&id001` anchors or `*id001` references for a reader to chase."""

    def ignore_aliases(self, data) -> bool:
        return True


def _text(dumper: yaml.SafeDumper, text: str):
    """Text of several lines (a component's patch) as a YAML block, the way people write it."""
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style="|" if "\n" in text else None)


NoAliases.add_representer(str, _text)


def labels(role: str) -> dict:
    return {"app.kubernetes.io/name": "baton", "app.kubernetes.io/component": role}


def secret_env(name: str, secret: str, key: str) -> dict:
    """An environment variable from a Secret that may not exist (then the variable is unset)."""
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": key, "optional": True}}}


def container(role: str, profile: dict) -> dict:
    port = PORTS[role]
    args = ["--host", "0.0.0.0", "--port", str(port), "--metrics-port", str(METRICS[role])]
    env = [{"name": "BATON_MODEL", "valueFrom": {"configMapKeyRef": {"name": "baton", "key": "model"}}},
           {"name": "BATON_LOG_FORMAT", "value": "json"}]
    ports = [{"name": "grpc", "containerPort": port}, {"name": "metrics", "containerPort": METRICS[role]}]
    if role == "router":
        args += ["--prefill", f"baton-prefill:{PORTS['prefill']}", "--decode", f"baton-decode:{PORTS['decode']}",
                 "--http-port", str(HTTP_PORT)]
        env.append(secret_env("BATON_AUTH_TOKEN", "baton-auth", "token"))
        ports.append({"name": "http", "containerPort": HTTP_PORT})
        resources = {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"memory": "2Gi"}}
    else:
        args += profile["device"]
        # peers dial the pod's IP; the KV secret proves prefill and decode to each other
        env += [{"name": "BATON_ADVERTISE_HOST", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                secret_env("BATON_KV_SECRET", "baton-kv", "secret")]
        if role == "decode":
            args += ["--kv-port", str(KV_PORT)]
            ports.append({"name": "kv", "containerPort": KV_PORT})
        resources = profile["worker"]
    grpc_probe = {"grpc": {"port": port}}
    return {
        # the image's ENTRYPOINT is `baton`: the arguments are its subcommand and flags
        "name": role, "image": profile["image"], "imagePullPolicy": "IfNotPresent",
        "args": [role, *args], "env": env, "ports": ports, "resources": resources,
        "volumeMounts": [{"name": "hf-cache", "mountPath": HF_CACHE}],
        # loading a model takes minutes on a cold node: the startup probe allows 10
        "startupProbe": {**grpc_probe, "periodSeconds": 5, "failureThreshold": 120},
        # ready = SERVING; a draining worker answers NOT_SERVING, leaves the Service's DNS and
        # the router stops sending it requests, while it finishes the ones it has
        "readinessProbe": {**grpc_probe, "periodSeconds": 5, "failureThreshold": 2},
        # alive = its port answers: a draining worker is not restarted
        "livenessProbe": {"tcpSocket": {"port": port}, "periodSeconds": 10, "failureThreshold": 6},
    }


def deployment(role: str, profile: dict) -> dict:
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": f"baton-{role}", "labels": labels(role)},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": labels(role)},
            # a new pod is ready before an old one drains: no request lost on a rollout
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": {
                "metadata": {"labels": labels(role), "annotations": {
                    "prometheus.io/scrape": "true", "prometheus.io/port": str(METRICS[role])}},
                "spec": {
                    "restartPolicy": "Always",              # a crashed process comes back
                    # longer than --grace (30 s): in-flight streams finish before SIGKILL
                    "terminationGracePeriodSeconds": 45,
                    # the images run as the user baton (uid 1000); fsGroup makes mounted volumes its own
                    "securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 1000, "fsGroup": 1000},
                    "containers": [container(role, profile)],
                    # Hub models (BATON_MODEL=ORG/NAME): per pod here; components/model-pvc shares one volume
                    "volumes": [{"name": "hf-cache", "emptyDir": {}}],
                },
            },
        },
    }


def worker_service(role: str) -> dict:
    """Headless: the name resolves to every ready pod's IP, which the router re-resolves."""
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": f"baton-{role}", "labels": labels(role)},
        "spec": {"clusterIP": "None", "selector": labels(role),
                 "ports": [{"name": "grpc", "port": PORTS[role], "targetPort": "grpc"},
                           {"name": "metrics", "port": METRICS[role], "targetPort": "metrics"}]},
    }


def router_service() -> dict:
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "baton", "labels": labels("router")},
        "spec": {"selector": labels("router"), "ports": [
            {"name": "grpc", "port": PORTS["router"], "targetPort": "grpc", "appProtocol": "grpc"},
            {"name": "http", "port": HTTP_PORT, "targetPort": "http"},
            {"name": "metrics", "port": METRICS["router"], "targetPort": "metrics"}]},
    }


def config_map() -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "baton", "labels": labels("config")},
            "data": {"model": "smollm2-135m-instruct"}}


def manifests(name: str) -> list[dict]:
    profile = PROFILES[name]
    return [config_map(), worker_service("prefill"), worker_service("decode"), router_service(),
            *(deployment(role, profile) for role in ROLES)]


# -- Kustomize components: what a site adds in its overlay (`components: [../components/hpa]`) --------
def service_monitor() -> dict:
    """Prometheus Operator: every Baton Service's `metrics` port (the router's carries vLLM's names too)."""
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor",
            "metadata": {"name": "baton", "labels": labels("monitoring")},
            "spec": {"selector": {"matchLabels": {"app.kubernetes.io/name": "baton"}},
                     "endpoints": [{"port": "metrics", "path": "/metrics", "interval": "15s"}]}}


def autoscaler(role: str) -> dict:
    """Workers scaled on what each pod reports: requests waiting, and KV cache in use. Pods metrics
    come from a custom-metrics adapter (prometheus-adapter) serving the workers' baton_waiting and
    baton_kv_cache_usage_ratio under those names."""
    metric = [{"type": "Pods", "pods": {"metric": {"name": "baton_waiting"},
                                        "target": {"type": "AverageValue", "averageValue": "4"}}}]
    if role == "decode":
        metric.append({"type": "Pods", "pods": {"metric": {"name": "baton_kv_cache_usage_ratio"},
                                                "target": {"type": "AverageValue", "averageValue": "800m"}}})
    return {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
            "metadata": {"name": f"baton-{role}", "labels": labels(role)},
            "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": f"baton-{role}"},
                     "minReplicas": 1, "maxReplicas": 8, "metrics": metric,
                     # a new worker takes minutes to load: do not give one back for a lull of seconds
                     "behavior": {"scaleDown": {"stabilizationWindowSeconds": 300}}}}


def disruption_budget(role: str) -> dict:
    """A drain takes one pod of a role at a time; it finishes its streams (grace) before the next."""
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": {"name": f"baton-{role}", "labels": labels(role)},
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": labels(role)}}}


def model_claim() -> dict:
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": {"name": "baton-models", "labels": labels("models")},
            "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "100Gi"}}}}


def patch(role: str, ops: list[dict]) -> dict:
    """A JSON 6902 patch of one role's Deployment."""
    return {"target": {"group": "apps", "version": "v1", "kind": "Deployment", "name": f"baton-{role}"},
            "patch": yaml.dump(ops, Dumper=NoAliases, sort_keys=False, default_flow_style=False)}


SHM = [{"op": "add", "path": "/spec/template/spec/volumes/-",
        "value": {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}}},
       {"op": "add", "path": "/spec/template/spec/containers/0/volumeMounts/-",
        "value": {"name": "dshm", "mountPath": "/dev/shm"}}]
PVC = [{"op": "replace", "path": "/spec/template/spec/volumes/0",
        "value": {"name": "hf-cache", "persistentVolumeClaim": {"claimName": "baton-models"}}}]

COMPONENTS = {
    # name: (what it is for, its resources, its patches)
    "servicemonitor": ("Prometheus Operator scrapes every Baton pod's metrics port", [service_monitor()], []),
    "hpa": ("decode and prefill workers scaled on waiting requests (and KV usage); needs a custom-metrics adapter",
            [autoscaler("decode"), autoscaler("prefill")], []),
    "pdb": ("a node drain takes one pod of each role at a time", [disruption_budget(r) for r in ROLES], []),
    "shm": ("a memory-backed /dev/shm for the workers (NCCL / HCCL, torch's shared tensors)", [],
            [patch(r, SHM) for r in ("prefill", "decode")]),
    "model-pvc": ("one ReadWriteMany volume holds the HF cache for every pod: a Hub model is downloaded once",
                  [model_claim()], [patch(r, PVC) for r in ROLES]),
}


# what a component needs from the cluster, said where a reader of its files meets it
NOTES = {
    "servicemonitor": ["Needs the Prometheus Operator (its ServiceMonitor CRD) and a Prometheus selecting this label set."],
    "hpa": ["Needs a custom-metrics adapter serving each worker pod's own gauges under these names; with",
            "prometheus-adapter, rules such as:",
            "  - seriesQuery: '{__name__=~\"baton_waiting|baton_kv_cache_usage_ratio\",namespace!=\"\",pod!=\"\"}'",
            "    resources: {overrides: {namespace: {resource: namespace}, pod: {resource: pod}}}",
            "    metricsQuery: max(<<.Series>>{<<.LabelMatchers>>}) by (<<.GroupBy>>)"],
    "model-pvc": ["Needs a StorageClass with ReadWriteMany volumes (NFS, CephFS, a cloud file store); set",
                  "storageClassName in an overlay where it is not the cluster's default."],
}


def render_component(name: str) -> dict[str, str]:
    why, resources, patches = COMPONENTS[name]
    kustomization = {"apiVersion": "kustomize.config.k8s.io/v1alpha1", "kind": "Component"}
    if resources:
        kustomization["resources"] = ["resources.yaml"]
    if patches:
        kustomization["patches"] = patches
    header = "".join(f"# {line}\n" for line in [f"Baton component {name}: {why}.", *NOTES.get(name, []),
                                                 "Generated by deploy/kubernetes/generate.py: edit that."])
    files = {"kustomization.yaml": header + yaml.dump(kustomization, Dumper=NoAliases, sort_keys=False, width=110)}
    if resources:
        files["resources.yaml"] = header + yaml.dump_all(resources, Dumper=NoAliases, sort_keys=False, width=110)
    return files


def render(name: str) -> dict[str, str]:
    """The files of one profile's directory."""
    header = (f"# Baton on Kubernetes, {name} profile. Generated by deploy/kubernetes/generate.py: edit that.\n"
              "# Optional Secrets: baton-auth (key token: the router's bearer token), baton-kv (key secret:\n"
              "# the KV secret shared by prefill and decode). See the README, 'Deploy on Kubernetes'.\n")
    docs = yaml.dump_all(manifests(name), Dumper=NoAliases, sort_keys=False, default_flow_style=False, width=110)
    kustomization = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
                     "resources": ["baton.yaml"]}
    return {"baton.yaml": header + docs,
            "kustomization.yaml": "# kubectl apply -k .  (or use this directory as a base of your own overlay)\n"
                                  + yaml.dump(kustomization, Dumper=NoAliases, sort_keys=False)}


def main() -> None:
    outputs = [(HERE / name, render(name)) for name in PROFILES]
    outputs += [(HERE / "components" / name, render_component(name)) for name in COMPONENTS]
    for folder, files in outputs:
        for file, text in files.items():
            path = folder / file
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path.relative_to(HERE.parent.parent)}", file=sys.stderr)


if __name__ == "__main__":
    main()
