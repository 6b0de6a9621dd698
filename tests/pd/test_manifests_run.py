"""The fleet as deploy/kubernetes runs it, without Kubernetes or Docker: the prefill, decode and
router containers' own args, env and probes, each process as the image's user (no home, the
pod's fsGroup as a group) reading its Secrets from files laid out as the kubelet mounts them
(root-owned, 0440, group fsGroup), on loopback. Only what cannot be had here is changed: the
Services' names become 127.0.0.1, the ports free ones, the 4 GiB pools small ones. A request
through the router is answered, and each node's readiness probe passes."""
from __future__ import annotations

import os
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import yaml
from certs import make_pki
from image_env import as_image_user, become_image_user_or_skip, image, image_env
from pd_cluster import ROOT

from kvfence.procs import free_ports, stop_processes

pytest.importorskip("mooncake.engine", reason="the PD tests need mooncake-transfer-engine-non-cuda")

KUBE = ROOT / "deploy" / "kubernetes"
PORTS = {"router": 8000, "prefill": 8001, "decode": 8002}   # as the manifests have them
KEY = "sk-manifest-tenant-0001"


def workload(role: str) -> dict:
    name = "router" if role == "router" else role
    kind = "Deployment" if role == "router" else "StatefulSet"
    return next(d for d in yaml.safe_load_all((KUBE / f"{name}.yaml").read_text()) if d and d["kind"] == kind)


def rewritten(words: list[str], root: Path, ports: dict[str, int]) -> list[str]:
    """A container's args or command with what only a cluster has replaced."""
    out = []
    for w in words:
        w = w.replace("/etc/kvfence/", f"{root}/etc/kvfence/").replace("$(POD_IP)", "127.0.0.1")
        for role in ("prefill", "decode"):
            w = w.replace(f"kvfence-{role}.kvfence.svc.cluster.local:{PORTS[role]}", f"127.0.0.1:{ports[role]}")
        out.append(w)
    for i, w in enumerate(out[:-1]):
        if w == "--port":
            out[i + 1] = str(ports[next(r for r, p in PORTS.items() if str(p) == out[i + 1])])
        elif w == "--host":
            out[i + 1] = "127.0.0.1"
        elif w == "--kv-cache-memory":
            out[i + 1] = "32MiB"
        elif w == "--threads":     # two processes on this machine's cores
            out[i + 1] = "1"
    return out


def mount_secrets(pod: dict, container: dict, root: Path, pki: dict[str, str]) -> None:
    """The pod's Secret volumes' files as the kubelet writes them: root's, with the volume's
    defaultMode, and with an fsGroup group-owned by it and 0440 added."""
    secret = "5" * 64
    files = {"kvfence-cluster": {"cluster.secret": secret, "accept.secret": secret},
             "kvfence-tls": {"ca.crt": Path(pki["ca"]).read_text(), "tls.crt": Path(pki["fleet_cert"]).read_text(),
                             "tls.key": Path(pki["fleet_key"]).read_text()},
             "kvfence-tenants": {"tenants.toml": f'[tenants.acme]\napi_keys = ["{KEY}"]\n'}}
    group = pod.get("securityContext", {}).get("fsGroup")
    volumes = {v["name"]: v["secret"] for v in pod["volumes"] if "secret" in v}
    for m in container["volumeMounts"]:
        if m["name"] not in volumes:
            continue
        folder = root / m["mountPath"].lstrip("/")
        folder.mkdir(parents=True, exist_ok=True)
        folder.chmod(0o755)
        for name, text in files[volumes[m["name"]]["secretName"]].items():
            (folder / name).write_text(text)
            os.chown(folder / name, 0, 0 if group is None else group)
            (folder / name).chmod(volumes[m["name"]].get("defaultMode", 0o644) | (0o440 if group is not None else 0))


def mount_volumes(pod: dict, container: dict, env: dict[str, str]) -> None:
    """A claim or emptyDir mounted over one of the image's ENV folders replaces it: the kubelet
    gives it to root and, with an fsGroup, to that group, group-writable and setgid."""
    group = pod.get("securityContext", {}).get("fsGroup")
    image_folders = {v: k for k, v in image()[0].items()}
    for m in container["volumeMounts"]:
        name = image_folders.get(m["mountPath"])
        if name is not None:
            folder = Path(env[name])
            os.chown(folder, 0, 0 if group is None else group)
            folder.chmod(0o2775 if group is not None else 0o755)


def test_the_manifests_fleet_serves_as_the_image_user(open_tmp):
    become_image_user_or_skip()
    root = open_tmp
    base = free_ports(3)
    ports = {"router": base, "prefill": base + 1, "decode": base + 2}
    (root / "pki").mkdir()
    pki = make_pki(root / "pki", ["127.0.0.1"])
    procs: dict[str, subprocess.Popen] = {}
    logs = {}
    try:
        for role in ("prefill", "decode", "router"):
            pod = workload(role)["spec"]["template"]["spec"]
            (c,) = pod["containers"]
            groups = tuple(g for g in [pod.get("securityContext", {}).get("fsGroup")] if g is not None)
            mount_secrets(pod, c, root / role, pki)
            env = image_env(root)
            mount_volumes(pod, c, env)
            env.update({e["name"]: "127.0.0.1" if "valueFrom" in e else e["value"] for e in c.get("env", [])})
            args = rewritten(c["args"], root / role, ports)
            if role != "router":   # the pools are small here: the context they hold
                args += ["--max-model-len", "1024"]
            logs[role] = open(root / f"{role}.log", "w+")
            procs[role] = subprocess.Popen(as_image_user([sys.executable, "-m", "kvfence.cli", *args], groups),
                                           env=env, cwd=root, stdout=logs[role], stderr=subprocess.STDOUT)

        def tail(role: str) -> str:
            return f"{role} (exit {procs[role].poll()}): {(root / f'{role}.log').read_text()[-2500:]}"

        # the router's readiness probe: HTTPS /health on its port, the kubelet not checking the certificate
        deadline = time.monotonic() + 240
        while True:
            for role, p in procs.items():
                assert p.poll() is None, tail(role)
            try:
                if httpx.get(f"https://127.0.0.1:{ports['router']}/health", verify=False, timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "\n".join(tail(r) for r in procs)
            time.sleep(1)
        # each node's readiness probe, the manifest's own command as the image's user
        for role in ("prefill", "decode"):
            (c,) = workload(role)["spec"]["template"]["spec"]["containers"]
            pod = workload(role)["spec"]["template"]["spec"]
            probe = rewritten(c["readinessProbe"]["exec"]["command"], root / role, ports)
            assert probe[0] == "kvfence"
            groups = tuple(g for g in [pod.get("securityContext", {}).get("fsGroup")] if g is not None)
            r = subprocess.run(as_image_user([sys.executable, "-m", "kvfence.cli", *probe[1:]], groups),
                               env=image_env(root), capture_output=True, text=True, timeout=60)
            assert r.returncode == 0, (role, r.stdout, r.stderr)
        # a tenant's request through the router, over its TLS
        tls = ssl.create_default_context(cafile=pki["ca"])
        client = openai.OpenAI(base_url=f"https://127.0.0.1:{ports['router']}/v1", api_key=KEY, max_retries=0,
                               http_client=httpx.Client(verify=tls, timeout=120))
        answer = client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=8, temperature=0,
                                                messages=[{"role": "user", "content": "The capital of France?"}])
        assert answer.choices[0].message.content and answer.usage.completion_tokens > 0
        # each process kept its incident log where the image put it
        made = sorted(p.name for p in (root / "xdg_state_home" / "kvfence").glob("incidents-*.jsonl"))
        assert made == sorted(f"incidents-{r}-{ports[r]}.jsonl" for r in procs), made
    finally:
        stop_processes(procs.values(), grace_s=30)
        for f in logs.values():
            f.close()
