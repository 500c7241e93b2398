"""Writes the Kubernetes manifests of each accelerator profile: deploy/kubernetes/<profile>/.

    python deploy/kubernetes/generate.py          # after editing this file; a test keeps them in step

One source, three plain-YAML directories (cpu, nvidia, ascend): `kubectl apply -k DIR` (or
`-f DIR/baton.yaml`) needs no Helm or Kustomize install, the YAML a reviewer reads is the YAML
the cluster gets, and the profiles cannot drift apart. Each directory is also a Kustomize base
for a site's own overlay (image registry, namespace, replicas, TLS).
"""
from __future__ import annotations

import sys
from pathlib import Path

import yaml

HERE = Path(__file__).parent
PORTS = {"router": 50051, "prefill": 50071, "decode": 50061}
KV_PORT = 50062                 # a decode worker's engine core takes KV pushes here (pod IP to pod IP)
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
        module = "baton.router"
        args += ["--prefill", f"baton-prefill:{PORTS['prefill']}", "--decode", f"baton-decode:{PORTS['decode']}",
                 "--http-port", str(HTTP_PORT)]
        env.append(secret_env("BATON_AUTH_TOKEN", "baton-auth", "token"))
        ports.append({"name": "http", "containerPort": HTTP_PORT})
        resources = {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"memory": "2Gi"}}
    else:
        module = f"baton.{role}_service"
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
        "name": role, "image": profile["image"], "imagePullPolicy": "IfNotPresent",
        "command": ["python", "-m", module], "args": args, "env": env, "ports": ports, "resources": resources,
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
                    "containers": [container(role, profile)],
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
                 "ports": [{"name": "grpc", "port": PORTS[role], "targetPort": "grpc"}]},
    }


def router_service() -> dict:
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "baton", "labels": labels("router")},
        "spec": {"selector": labels("router"), "ports": [
            {"name": "grpc", "port": PORTS["router"], "targetPort": "grpc", "appProtocol": "grpc"},
            {"name": "http", "port": HTTP_PORT, "targetPort": "http"}]},
    }


def config_map() -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "baton", "labels": labels("config")},
            "data": {"model": "smollm2-135m-instruct"}}


def manifests(name: str) -> list[dict]:
    profile = PROFILES[name]
    return [config_map(), worker_service("prefill"), worker_service("decode"), router_service(),
            *(deployment(role, profile) for role in ("prefill", "decode", "router"))]


def render(name: str) -> dict[str, str]:
    """The files of one profile's directory."""
    header = (f"# Baton on Kubernetes, {name} profile. Generated by deploy/kubernetes/generate.py: edit that.\n"
              "# Optional Secrets: baton-auth (key token: the router's bearer token), baton-kv (key secret:\n"
              "# the KV secret shared by prefill and decode). See the README, 'Deploy on Kubernetes'.\n")
    docs = yaml.safe_dump_all(manifests(name), sort_keys=False, default_flow_style=False, width=110)
    kustomization = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
                     "resources": ["baton.yaml"]}
    return {"baton.yaml": header + docs,
            "kustomization.yaml": "# kubectl apply -k .  (or use this directory as a base of your own overlay)\n"
                                  + yaml.safe_dump(kustomization, sort_keys=False)}


def main() -> None:
    for name in PROFILES:
        for file, text in render(name).items():
            path = HERE / name / file
            path.parent.mkdir(exist_ok=True)
            path.write_text(text)
            print(f"wrote {path.relative_to(HERE.parent.parent)}", file=sys.stderr)


if __name__ == "__main__":
    main()
