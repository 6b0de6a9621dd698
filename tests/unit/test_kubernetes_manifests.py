"""The Kubernetes manifests (deploy/kubernetes) are valid against the Kubernetes schemas
(kubernetes-validate, offline, strict: an unknown field is an error), and what they run is
a kvfence command line this version accepts, wired the way a sealed PD fleet needs: every
process has the cluster secret and TLS, nodes require client certificates, the router lists
every node pod by its stable name, and every container has both probes."""
from __future__ import annotations

import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = sorted((ROOT / "deploy" / "kubernetes").glob("*.yaml"))
K8S_VERSION = "1.33.0"


def _docs():
    out = []
    for path in MANIFESTS:
        if path.name == "kustomization.yaml":
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                out.append((path.name, doc))
    return out


DOCS = _docs()


def _by_kind(kind):
    return {d["metadata"]["name"]: d for _, d in DOCS if d["kind"] == kind}


def _container(workload):
    (c,) = workload["spec"]["template"]["spec"]["containers"]
    return c


def _parse(args):
    """args through kvfence's own argument parser (SystemExit on an unknown flag)."""
    from kvfence.cli import build_parser
    return build_parser().parse_args([str(x).replace("$(POD_IP)", "10.0.0.9") for x in args])


def test_every_manifest_validates_against_the_kubernetes_schemas():
    assert len(DOCS) >= 9, [n for n, _ in DOCS]
    for name, doc in DOCS:
        assert kubernetes_validate.validate(doc, K8S_VERSION, strict=True) is not None, name


def test_an_invalid_manifest_is_caught():
    """The check can fail: a misspelt field in a copy of the router Deployment."""
    bad = yaml.safe_load(yaml.safe_dump(_by_kind("Deployment")["kvfence-router"]))
    bad["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {"httpGet": {"path": "/health", "port": 8000}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def test_the_kustomization_lists_every_manifest_but_the_secrets():
    """The Secrets are the operator's to create: were secrets.yaml applied with the rest, each `kubectl
    apply -k` would write its placeholders over them and every process would refuse to start."""
    kust = yaml.safe_load((ROOT / "deploy" / "kubernetes" / "kustomization.yaml").read_text())
    assert sorted(kust["resources"]) == sorted(p.name for p in MANIFESTS
                                               if p.name not in ("kustomization.yaml", "secrets.yaml"))
    assert {d["kind"] for _, d in DOCS if _ == "secrets.yaml"} == {"Secret"}
    assert not [n for n, d in DOCS if d["kind"] == "Secret" and n != "secrets.yaml"]


@pytest.mark.parametrize("name", ["kvfence-prefill", "kvfence-decode", "kvfence-router"])
def test_each_process_runs_a_sealed_kvfence_command_with_both_probes(name):
    work = {**_by_kind("StatefulSet"), **_by_kind("Deployment")}[name]
    c = _container(work)
    a = _parse(c["args"])
    role = name.removeprefix("kvfence-")
    assert a.role == role and a.host == "0.0.0.0"
    assert a.cluster_secret_file and a.tls_cert and a.tls_key and a.tls_ca and not a.allow_plaintext_network
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    for f in (a.cluster_secret_file, a.tls_cert, a.tls_key, a.tls_ca, *(a.accept_cluster_secret_file or [])):
        assert str(Path(f).parent) in mounts, f
    # nodes accept a second key of the Secret, so the cluster rotates by editing it and a SIGHUP
    keys = _by_kind("Secret")["kvfence-cluster"]["stringData"]
    assert {Path(f).name for f in [a.cluster_secret_file, *(a.accept_cluster_secret_file or [])]} == (
        {"cluster.secret"} if role == "router" else {"cluster.secret", "accept.secret"}) and set(keys) >= {
        "cluster.secret", "accept.secret"}
    for probe in ("readinessProbe", "livenessProbe"):
        p = c[probe]
        if "exec" in p:   # nodes: kvfence probe, presenting the node's certificate
            pa = _parse(p["exec"]["command"][1:])
            assert pa.port == a.port and pa.tls_ca and pa.tls_client_cert
            assert pa.what == ("ready" if probe == "readinessProbe" else "live")
        else:
            assert p["httpGet"]["port"] == a.port and p["httpGet"]["scheme"] == "HTTPS"
            assert p["httpGet"]["path"] == ("/health" if probe == "readinessProbe" else "/health/live")
        # Kubernetes' default is 1 s: a loop paused a moment under load (or the probe command's
        # own ~3 s start) would fail probes, and failed liveness restarts every request on the pod
        assert p.get("timeoutSeconds", 1) >= 5, (role, probe)
    assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
    _can_read_its_secrets(work["spec"]["template"]["spec"], c)
    if role != "router":
        assert work["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= 120   # room to drain


def _can_read_its_secrets(pod: dict, c: dict) -> None:
    """The files of a Secret volume belong to root:root with the volume's mode, or to
    root:fsGroup with 0440 added when the pod has an fsGroup (the kubelet's rule; fsGroup is
    also among every container's groups). The image runs as 65534 (deploy/Dockerfile): each
    mounted Secret must be readable by that user, with a mode pd/seal.py's file check accepts
    (nothing for others, no group write)."""
    user = re.search(r"^USER (\d+)", (ROOT / "deploy" / "Dockerfile").read_text(), re.M)
    assert user is not None
    ctx = {**pod.get("securityContext", {}), **c.get("securityContext", {})}
    uid, group = ctx.get("runAsUser", int(user.group(1))), ctx.get("fsGroup")
    mounted = {m["name"] for m in c["volumeMounts"]}
    for v in pod["volumes"]:
        if v["name"] not in mounted or "secret" not in v:
            continue
        mode = v["secret"].get("defaultMode", 0o644) | (0o440 if group is not None else 0)
        assert mode & 0o026 == 0, (v["name"], oct(mode))
        assert uid == 0 or group is not None, (v["name"], oct(mode), ctx)


def test_the_secret_volume_check_can_fail():
    pod = {"volumes": [{"name": "cluster", "secret": {"secretName": "x", "defaultMode": 0o400}}]}
    c = {"volumeMounts": [{"name": "cluster", "mountPath": "/etc/kvfence/cluster"}]}
    with pytest.raises(AssertionError):
        _can_read_its_secrets(pod, c)   # no fsGroup: root's 0400 files, a process run as 65534
    _can_read_its_secrets({**pod, "securityContext": {"fsGroup": 65534}}, c)
    loose = {"volumes": [{"name": "cluster", "secret": {"secretName": "x", "defaultMode": 0o644}}],
             "securityContext": {"fsGroup": 65534}}
    with pytest.raises(AssertionError):
        _can_read_its_secrets(loose, c)   # readable, but by others too: the secret file check refuses it


def test_the_router_follows_each_node_services_name():
    """The router's node URLs are the headless Services' names (each resolves to every
    pod's address, kvfence/pd/addresses.py), on the port the Service and the pods use."""
    a = _parse(_container(_by_kind("Deployment")["kvfence-router"])["args"])
    services = _by_kind("Service")
    for role, flag in (("prefill", a.prefill_url), ("decode", a.decode_url)):
        sts = _by_kind("StatefulSet")[f"kvfence-{role}"]
        svc = services[sts["spec"]["serviceName"]]
        assert svc["spec"]["clusterIP"] == "None"        # headless: the name resolves to the pods themselves
        assert svc["spec"]["publishNotReadyAddresses"] is True   # the router checks a pod before it serves
        port = svc["spec"]["ports"][0]["port"]
        assert ",".join(flag).split(",") == [f"https://{svc['metadata']['name']}.kvfence.svc.cluster.local:{port}"]
        pod_args = _parse(_container(sts)["args"])
        assert pod_args.port == port


def test_the_shipped_secrets_are_placeholders_every_process_refuses():
    from kvfence.pd.seal import SecretError, load_secret
    for secret in _by_kind("Secret")["kvfence-cluster"]["stringData"].values():
        with pytest.raises(SecretError):
            load_secret(env={"KVFENCE_CLUSTER_SECRET": secret})
    assert all("REPLACE-ME" in v for v in _by_kind("Secret")["kvfence-tls"]["stringData"].values())


def test_the_image_runs_the_readme_set_up_and_the_readme_points_at_it():
    docker = (ROOT / "deploy" / "Dockerfile").read_text()
    assert "bash scripts/setup.sh" in docker and 'ENTRYPOINT ["kvfence"]' in docker
    assert all(c["image"] == "kvfence:latest" for kind in ("StatefulSet", "Deployment")
               for c in [_container(w) for w in _by_kind(kind).values()])
    assert "deploy/kubernetes" in (ROOT / "README.md").read_text()


def test_the_image_compiles_its_kernels_where_its_user_finds_them():
    """The set-up compiles the CPU kernels into KVFENCE_CACHE_DIR, else ~/.cache: in the image it runs
    as root, and the pods run as 65534 (home /nonexistent), so without the variable set before it
    and the folder given to that user every pod found no kernels and ran plain torch ops."""
    docker = _dockerfile()
    cache = re.search(r"^ENV KVFENCE_CACHE_DIR=(\S+)$", docker, re.M)
    user = re.search(r"^USER (\d+):(\d+)$", docker, re.M)
    setup = re.search(r"^RUN bash scripts/setup.sh(.*)$", docker, re.M)
    assert cache and user and setup, docker
    assert cache.start() < setup.start() < user.start()
    assert re.search(rf"chown -R {user[1]}:{user[2]} [^\n]*{re.escape(cache[1])}\b", setup[1]), setup[1]


def _dockerfile() -> str:
    """The Dockerfile with each instruction on one line (continuations joined)."""
    return re.sub(r"\\\n\s*", " ", (ROOT / "deploy" / "Dockerfile").read_text())


def _image_env(name: str) -> str:
    found = re.search(rf"^ENV {name}=(\S+)$", _dockerfile(), re.M)
    assert found, name
    return found[1]


@pytest.mark.parametrize("name", ["kvfence-prefill", "kvfence-decode"])
def test_each_node_runs_as_many_threads_as_the_cpus_it_requests(name):
    """A pod sees all of its node's cores: left to its default, a node ran a thread per core of a
    64-core machine on the 4 CPUs it asked for (and a CPU limit, which the default would follow,
    is not set)."""
    c = _container(_by_kind("StatefulSet")[name])
    assert "cpu" not in c["resources"].get("limits", {})
    assert _parse(c["args"]).threads == int(c["resources"]["requests"]["cpu"])


@pytest.mark.parametrize("name", ["kvfence-prefill", "kvfence-decode", "kvfence-router"])
def test_each_pod_keeps_its_incident_log_on_a_volume_it_can_write(name):
    """A process that cannot open its incident log refuses to start, and the image's user has no
    home to put it in: the image points XDG_STATE_HOME at a folder of its own, and each pod mounts a
    writable volume there, a claim per node pod (the audit trail outlives the pod), an emptyDir
    for the router's (a Deployment's pods have no claims of their own)."""
    state = _image_env("XDG_STATE_HOME")
    docker = _dockerfile()
    assert re.search(rf"chown -R 65534:65534 [^\n]*{re.escape(state)}\b", docker), docker
    work = {**_by_kind("StatefulSet"), **_by_kind("Deployment")}[name]
    pod, c = work["spec"]["template"]["spec"], _container(work)
    (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == state]
    assert not mount.get("readOnly"), mount
    claims = {t["metadata"]["name"]: t for t in work["spec"].get("volumeClaimTemplates", [])}
    if work["kind"] == "StatefulSet":
        assert mount["name"] in claims and claims[mount["name"]]["spec"]["accessModes"] == ["ReadWriteOnce"]
    else:
        (vol,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
        assert "emptyDir" in vol, vol
    args = _parse(c["args"])
    assert args.incident_log is None   # the default path, under XDG_STATE_HOME


# -- who may connect to what (network-policy.yaml) ---------------------------------------------
NAMESPACE = "kvfence"
MOONCAKE_PORT = 40123   # Mooncake picks its handshake and data ports at start: any port stands for them


def _pod(component: str | None, namespace: str = NAMESPACE) -> tuple[str, dict]:
    labels = {"app.kubernetes.io/name": "kvfence", "app.kubernetes.io/component": component} if component else {}
    return namespace, labels


def _matches(selector: dict, labels: dict) -> bool:
    assert set(selector) <= {"matchLabels"}, selector    # the evaluator below knows no more
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def _peer_matches(peer: dict, src: tuple[str, dict]) -> bool:
    assert set(peer) == {"podSelector"}, peer              # same namespace, by labels
    return src[0] == NAMESPACE and _matches(peer["podSelector"], src[1])


def _port_matches(entry: dict, port: int) -> bool:
    return entry.get("protocol", "TCP") == "TCP" and entry.get("port", port) == port


def _may_connect(src: tuple[str, dict], dst: tuple[str, dict], port: int, docs=None) -> bool:
    """NetworkPolicy's ingress rule: a pod no policy selects takes anything; a selected one
    takes what one rule of one selecting policy allows (no `from`: any peer; no `ports`: any port)."""
    docs = DOCS if docs is None else docs
    policies = [d for _, d in docs if d["kind"] == "NetworkPolicy" and d["metadata"]["namespace"] == dst[0]
                and "Ingress" in d["spec"]["policyTypes"] and _matches(d["spec"]["podSelector"], dst[1])]
    if not policies:
        return True
    return any(("from" not in rule or any(_peer_matches(p, src) for p in rule["from"]))
               and ("ports" not in rule or any(_port_matches(e, port) for e in rule["ports"]))
               for pol in policies for rule in pol["spec"].get("ingress", []))


def _port(role: str) -> int:
    work = {**_by_kind("StatefulSet"), **_by_kind("Deployment")}[f"kvfence-{role}"]
    assert work["spec"]["template"]["metadata"]["labels"] == _pod(role)[1]   # what the policies select
    return _parse(_container(work)["args"]).port


def test_only_the_router_reaches_a_nodes_internal_api_and_only_the_other_role_its_transfer_ports():
    """Mooncake's ports authenticate nothing and listen on all interfaces: sealed rows keep
    the KV unreadable, but anyone reaching them could fail every PD request, and anyone
    reaching a node's internal port could guess at its credential."""
    outsider, neighbour = _pod(None, "default"), _pod(None)
    router, prefill, decode = _pod("router"), _pod("prefill"), _pod("decode")
    for stranger in (outsider, neighbour):
        assert _may_connect(stranger, router, _port("router"))                 # the public API
        for node, role in ((prefill, "prefill"), (decode, "decode")):
            for port in (_port(role), MOONCAKE_PORT):
                assert not _may_connect(stranger, node, port), (stranger, role, port)
        assert not _may_connect(stranger, neighbour, 8080)    # deny by default: a pod added later too
    assert _may_connect(router, prefill, _port("prefill")) and _may_connect(router, decode, _port("decode"))
    assert not _may_connect(router, prefill, MOONCAKE_PORT) and not _may_connect(router, decode, MOONCAKE_PORT)
    assert _may_connect(decode, prefill, MOONCAKE_PORT) and _may_connect(prefill, decode, MOONCAKE_PORT)
    assert not _may_connect(prefill, prefill, _port("prefill"))   # a node calls no node's internal API


def test_the_policy_check_can_fail():
    """The evaluator is not vacuous: without the policies, a stranger reaches a node."""
    others = [(n, d) for n, d in DOCS if d["kind"] != "NetworkPolicy"]
    assert _may_connect(_pod(None, "default"), _pod("prefill"), MOONCAKE_PORT, others)
