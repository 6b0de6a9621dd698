"""`kvfence launch-pd`: a prefill node, a decode node and a router on this machine.

Three processes, as in production (where they are three machines), on loopback: the
router on --port, prefill on --port+1, decode on --port+2. The CPU cores are split between
the two nodes so their thread pools do not fight (OMP_WAIT_POLICY=PASSIVE as well: a
spinning OpenMP pool next to another process was measured ~40x slower). A node that exits
(a drain, a crash, or a broken engine's exit code 70) is started again (RestartPolicy); the
router checks the new boot (I8) before routing to it. A node that keeps failing is left
stopped while others of its role serve; if the router exits, or the last node of a role keeps
failing, the others are stopped and the exit code says which.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

from kvfence.cores import usable_cores
from kvfence.pd.seal import load_secret, new_secret
from kvfence.procs import start_child, stop_processes
from kvfence.server.shutdown import BACKSTOP_S, DEFAULT_SHUTDOWN_TIMEOUT_S

# the engine options a node takes from launch-pd's (and the PD bench's) command line
# (every one of cli._engine_args but --threads, which launch-pd splits between the nodes)
ENGINE_FLAGS = ("model", "dtype", "device", "weights", "matmul", "kv_cache_memory", "kv_memory_fraction",
                "page_size", "max_model_len", "clamp_context", "max_num_seqs", "max_num_batched_tokens",
                "max_waiting", "prefill_tokens_while_decoding", "decode_step_target_ms", "scrub", "no_prefix_cache",
                "audit_reads")
PD_FLAGS = ("transfer_host", "transfer_buffer_pages", "lease", "transfer_timeout", "max_pull", "clock_skew",
            "decode_reserve_tokens", "router_scope_idle")


def flags(a, names) -> list[str]:
    """The options `names` as given on `a`: a switch (True) by its name alone, False and None left out."""
    out = []
    for n in names:
        v = getattr(a, n, None)
        if v is True:
            out.append(f"--{n.replace('_', '-')}")
        elif v is not None and v is not False:
            out += [f"--{n.replace('_', '-')}", str(v)]
    return out


def node_names(a) -> dict[str, list[str]]:
    """role -> the names of its processes: prefill, prefill-2, ..., decode, decode-2, ..."""
    counts = {role: 1 if getattr(a, role, None) is None else getattr(a, role) for role in ("prefill", "decode")}
    if any(n < 1 for n in counts.values()):
        raise ValueError(f"a cluster needs at least one prefill and one decode node; got {counts}")
    return {role: [role if i == 1 else f"{role}-{i}" for i in range(1, n + 1)] for role, n in counts.items()}


def node_commands(a, secret_file: str) -> dict[str, list[str]]:
    """Every process's command line (the router on --port, prefill nodes on the ports after
    it, then decode nodes); each reads the cluster secret from secret_file."""
    names = node_names(a)
    nodes = [(role, name) for role in ("prefill", "decode") for name in names[role]]
    if a.port + len(nodes) > 65535:
        raise ValueError(f"the nodes take the {len(nodes)} ports after --port {a.port}, past 65535; "
                         "choose a lower --port")
    cores = usable_cores()
    base = [sys.executable, "-m", "kvfence.cli"] + (["-v"] if getattr(a, "verbose", False) else [])
    engine = flags(a, ENGINE_FLAGS)
    tenants = ["--tenants", a.tenants] if a.tenants else []
    secret = ["--cluster-secret-file", secret_file]
    accepted = [f for path in getattr(a, "accept_cluster_secret_file", None) or [] for f in (
        "--accept-cluster-secret-file", path)]   # nodes only: a router sends, it accepts nothing
    # the router's deadline for what is in flight when it stops; a node's drain limit
    stop = ["--shutdown-timeout", str(a.shutdown_timeout)] if getattr(a, "shutdown_timeout", None) else []
    cmds: dict[str, list[str]] = {}
    urls: dict[str, list[str]] = {"prefill": [], "decode": []}
    for i, (role, name) in enumerate(nodes, start=1):
        # the cores split between the nodes; with one pair, the decode node takes the odd one
        share = cores // len(nodes) + (1 if len(nodes) == 2 and role == "decode" and cores % 2 else 0)
        cmds[name] = base + ["serve", "--role", role, "--host", a.host, "--port", str(a.port + i),
                             "--threads", str(a.threads or max(1, share))] + engine + flags(a, PD_FLAGS) + \
            tenants + secret + accepted + stop
        urls[role].append(f"http://{a.host}:{a.port + i}")
    cmds["router"] = base + ["serve", "--role", "router", "--host", a.host, "--port", str(a.port),
                             "--prefill-url", ",".join(urls["prefill"]),
                             "--decode-url", ",".join(urls["decode"])] + tenants + secret + stop + (
        ["--model", a.model] if a.model else []) + (
        ["--max-model-len", str(a.max_model_len)] if a.max_model_len else []) + (
        ["--clamp-context"] if a.clamp_context else []) + (
        ["--served-model-name", a.served_model_name] if a.served_model_name else []) + flags(
        a, ("prefill_routing", "max_body_bytes"))
    return cmds


def write_secret_file(directory: str | None = None) -> str:
    """A fresh cluster secret in a file only its owner can read; returns the path."""
    fd, path = tempfile.mkstemp(prefix="kvfence-cluster-", suffix=".secret", dir=directory)
    with os.fdopen(fd, "w") as f:   # mkstemp creates it 0600
        f.write(new_secret() + "\n")
    return path


def launch_pd(a) -> int:
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    nodes = sum(len(n) for n in node_names(a).values())   # what each child would refuse, refused here first
    if a.tenants:
        from kvfence.server.tenants import TenantRegistry

        TenantRegistry.from_file(a.tenants)
    for path in [a.cluster_secret_file, *(getattr(a, "accept_cluster_secret_file", None) or [])]:
        if path is not None:
            load_secret(path)
    from kvfence.server.http_limits import port_unavailable

    for port in range(a.port, a.port + 1 + nodes):
        if port <= 65535 and (why := port_unavailable(a.host, port)) is not None:
            raise OSError(f"port {port} of this cluster's (router {a.port}, nodes after it): {why}; choose "
                          "another --port, or stop what listens there")
    secret_file = a.cluster_secret_file
    if secret_file is None:
        secret_file = write_secret_file()
        print(f"kvfence launch-pd: made a random cluster secret for this cluster in {secret_file} (0600; removed "
              f"on exit); clients of the nodes' internal API need it: KVFENCE_CLUSTER_SECRET_FILE={secret_file}",
              file=sys.stderr)
    try:
        return _run(a, env, secret_file)
    finally:
        if a.cluster_secret_file is None:
            os.unlink(secret_file)


# A node that exits is started again: at once after a clean exit (code 0 once it listened: a
# drain, or the SIGTERM of a rolling restart), and after each of up to MAX_RESTARTS failures
# in a row; a failure after it had listened for HEALTHY_S is a first one again. At the next
# failure it is left stopped if another node of its role is up and listening (the router
# routes around it); the last of its role, or the router's own exit, stops everything, and the
# exit code says which. Before, any node's 4th exit in the cluster's life, drains included,
# stopped every process (found by a fleet probe).
MAX_RESTARTS = 3
HEALTHY_S = 60.0   # listening this long (its model loaded): its failures so far are forgiven
# exit codes of a process that refused to start (its configuration, a port it cannot listen
# on): started again, it would refuse again (serve.py's EXIT_CANNOT_LISTEN is 3). Only before
# it first listened: a node that served and then failed is restarted whatever its code
REFUSED_TO_START = (2, 3)


def router_stop_s(a) -> float:
    """How long the router may take to stop: its --shutdown-timeout, the backstop, and a margin."""
    return (getattr(a, "shutdown_timeout", None) or DEFAULT_SHUTDOWN_TIMEOUT_S) + BACKSTOP_S + 5.0


def role_of(name: str) -> str:
    """prefill-2 -> prefill; router -> router."""
    return name.split("-", 1)[0]


class RestartPolicy:
    """What launch-pd does when one of its processes exits: "restart", "leave" (stopped; others
    of its role serve) or "stop" (every process). Times are passed in, for the tests."""

    def __init__(self, names: list[str]):
        self.names = names
        self.failures = dict.fromkeys(names, 0)    # in a row
        self.listening_since: dict[str, float] = {}   # processes up and listening, since when
        self.left: set[str] = set()

    def listening(self, name: str, now: float) -> None:
        """Its process was seen listening (loading its model does not count): after HEALTHY_S
        of it, its failures so far are forgiven."""
        since = self.listening_since.setdefault(name, now)
        if now - since >= HEALTHY_S:
            self.failures[name] = 0

    def exited(self, name: str) -> bool:
        """Its process is gone (every one that exited, before on_exit decides for any): whether
        it had listened."""
        return self.listening_since.pop(name, None) is not None

    def on_exit(self, name: str, code: int, listened: bool) -> str:
        if name == "router":
            return "stop"
        if code == 0 and listened:
            return "restart"   # a drain or a requested stop: not a failure
        self.failures[name] += 1
        refused = code in REFUSED_TO_START and not listened   # it would refuse again
        if not refused and self.failures[name] <= MAX_RESTARTS:
            return "restart"
        if not any(role_of(n) == role_of(name) for n in self.listening_since):
            return "stop"   # no other node of its role serves
        self.left.add(name)
        return "leave"


def _listening(host: str, port: str) -> bool:
    try:
        socket.create_connection((host, int(port)), timeout=0.2).close()
        return True
    except OSError:
        return False


def _run(a, env: dict[str, str], secret_file: str) -> int:
    procs: dict[str, subprocess.Popen] = {}
    cmds = node_commands(a, secret_file)
    ports = {name: cmd[cmd.index("--port") + 1] for name, cmd in cmds.items()}
    policy = RestartPolicy(list(cmds))
    for role, cmd in cmds.items():
        procs[role] = start_child(cmd, hold_hangup=True, env=env)
        print(f"kvfence launch-pd: started {role} on port {ports[role]} (pid {procs[role].pid}): "
              f"{' '.join(cmd[2:])}", file=sys.stderr)
    print(f"kvfence launch-pd: the OpenAI API will be at http://{a.host}:{a.port}/v1 once the router reports "
          f"ready; cluster check at http://{a.host}:{a.port}/v1/kvfence/cluster", file=sys.stderr)

    stopping: list[int] = []

    def stop(signum, _frame):
        stopping.append(signum)

    def reload_tenants(*_):
        # every process read the tenants file (the nodes key their status routes with it) and its
        # cluster secret files: each reads them again
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGHUP)
        print("kvfence launch-pd: SIGHUP passed on: every process reloads its tenants file and cluster secret files",
              file=sys.stderr)

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGHUP, reload_tenants)
    code = 0
    try:
        while not stopping:
            now = time.monotonic()
            dead = {r: p.returncode for r, p in procs.items() if p.poll() is not None}
            for r in procs:
                if r not in dead and (r in policy.listening_since or _listening(a.host, ports[r])):
                    policy.listening(r, now)
            listened = {r: policy.exited(r) for r in dead}   # all of them gone before any decision
            fatal = None
            for role, rc in dead.items():
                what = policy.on_exit(role, rc, listened[role])
                if what == "stop":
                    fatal = (role, rc)
                    break
                if what == "leave":
                    del procs[role]
                    print(f"kvfence launch-pd: {role} exited with code {rc}, failing {policy.failures[role]} "
                          f"times in a row; left stopped while the other {role_of(role)} nodes serve (restart "
                          "launch-pd to bring it back)", file=sys.stderr)
                    continue
                procs[role] = start_child(cmds[role], hold_hangup=True, env=env)
                why = "a clean exit (a drain?)" if rc == 0 and listened[role] else \
                    f"failure {policy.failures[role]} in a row; failure {MAX_RESTARTS + 1} is not restarted"
                print(f"kvfence launch-pd: {role} exited with code {rc}; restarted it (pid {procs[role].pid}; "
                      f"{why}); the router checks it again before it serves", file=sys.stderr)
            if fatal is not None:
                role, code = fatal
                print(f"kvfence launch-pd: {role} exited with code {code}"
                      f"{'' if role == 'router' else ', and no other ' + role_of(role) + ' node serves'}; "
                      "stopping the others", file=sys.stderr)
                code = code or 1
                break
            time.sleep(0.5)
    finally:
        # the router first: it ends what is in flight with a 503 by its --shutdown-timeout
        # (SIGKILL at 20 s, with the nodes, cut its clients off with no word), then the nodes
        stop_processes([p for r, p in procs.items() if r == "router"], grace_s=router_stop_s(a))
        stop_processes([p for r, p in procs.items() if r != "router"], grace_s=20)
    if stopping and stopping[0] == signal.SIGINT:
        return 130   # Ctrl-C, as a shell reports it (SIGTERM is a requested stop: 0)
    return code
