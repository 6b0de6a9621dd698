"""What an operator gets wrong on the command line is refused at once, in one line, naming the
option (found by a CLI probe: a negative request count hung the bench, a soak of 0 s passed,
--port 70000 failed after the model loaded, a truncated GGUF ended in an IndexError, launch-pd
restarted a node that refused its configuration, and Ctrl-C printed a traceback)."""
from __future__ import annotations

import sys

import pytest

from kvfence.cli import build_parser, main


@pytest.mark.parametrize("argv,says", [
    (["bench", "--num-requests", "-3"], "--num-requests: must be at least 1"),
    (["bench", "--url", "http://x", "--concurrency", "-2"], "--concurrency: must be at least 1"),
    (["bench", "--repeat", "0"], "--repeat: must be at least 1"),
    (["bench", "--url", "http://x", "--timeout", "0"], "--timeout: must be a finite number of seconds"),
    (["bench", "--json", "/nonexistent/x.json"], "no folder /nonexistent"),
    (["serve", "--port", "70000"], "a TCP port is 1-65535"),
    (["serve", "--max-body-bytes", "0"], "--max-body-bytes: must be at least 1"),
    (["serve", "--role", "router", "--node-wait", "nan"], "--node-wait: must be a finite number"),
    (["launch-pd", "--port", "0"], "a TCP port is 1-65535"),
    (["serve", "--port", "-1"], "a TCP port is 1-65535"),
    (["probe", "--timeout", "0"], "--timeout"),
    (["soak", "--duration", "0"], "--duration: must be longer than 0"),
    (["soak", "--duration", "abc"], "not a duration: 'abc'"),
    (["soak", "--concurrency", "0"], "--concurrency: must be at least 1"),
    (["soak", "--json", "/nonexistent/x.json"], "no folder /nonexistent"),
    (["soak", "--logdir", "/etc/passwd"], "exists and is not a folder"),
    (["canary", "--url", "u", "--tenants-file", "t", "--nodes", "garbage"], "expected prefill=URL,decode=URL"),
    (["canary", "--url", "u", "--tenants-file", "t", "--kill", "garbage"], "expected ROLE@SECONDS"),
    (["canary", "--url", "u", "--tenants-file", "t", "--aborts", "2"], "must be between 0 and 1"),
    (["incidents", "--expect-last-hash", "zzz"], "not a SHA-256 hash"),
    (["isolation", "--url", "https://x", "--tls-ca", "/nonexistent/ca.crt"], "cannot read CA certificates"),
    (["bench", "--url", "https://x", "--tls-ca", "/etc/hostname"], "cannot read CA certificates"),
    (["canary", "--url", "u", "--tenants-file", "t", "--tls-ca", "/nonexistent"], "cannot read CA certificates"),
])
def test_a_value_that_cannot_work_is_refused_by_name(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(argv)
    assert e.value.code == 2 and says in capsys.readouterr().err


@pytest.mark.parametrize("argv,says", [
    (["--seeds", "0"], "--seeds: must be at least 1"),
    (["--lives", "-5"], "--lives: must be at least 1"),
    (["--fault", "nosuch"], "--fault 'nosuch': unknown fault 'nosuch'"),
    (["--fault", "skip_ledger_check,nosuch"], "unknown fault 'nosuch'"),   # a comma list, as before
])
def test_the_simulation_refuses_what_would_run_nothing(argv, says, capsys):
    from kvfence.sim.run import main as sim_main

    with pytest.raises(SystemExit) as e:
        sim_main(argv)
    assert e.value.code == 2 and says in capsys.readouterr().err


def test_bench_modes_one_at_a_time_and_known_peers(capsys):
    assert main(["bench", "--pd", "--structured"]) == 2
    assert "--pd and --structured are separate benches" in capsys.readouterr().err
    assert main(["bench", "--fleet", "--url", "http://127.0.0.1:1"]) == 2
    assert main(["bench", "--quick", "--peers", "transformers,nosuch"]) == 2
    assert "unknown --peers nosuch" in capsys.readouterr().err


def test_a_server_that_is_not_there_is_one_line_with_its_url(capsys):
    assert main(["isolation", "--url", "http://127.0.0.1:1"]) == 2
    err = capsys.readouterr().err
    assert "http://127.0.0.1:1/v1/kvfence/isolation" in err and "Traceback" not in err


def test_ctrl_c_is_one_line_and_exit_130(monkeypatch, capsys):
    from kvfence import cli

    def interrupted(a):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "cmd_info", interrupted)
    assert main(["info"]) == 130
    assert capsys.readouterr().err.strip() == "interrupted"


def test_a_model_file_cut_short_or_not_a_model_says_so(tmp_path):
    import torch

    from kvfence.model.loader import default_model_path, load_model

    cut = tmp_path / "cut.gguf"
    with open(default_model_path(), "rb") as f:
        cut.write_bytes(f.read(1 << 20))
    with pytest.raises(ValueError, match=f"cannot read {cut} as a GGUF model \\(is the file complete\\?\\)"):
        load_model(cut, torch.float32, "cpu", progress=False)
    other = tmp_path / "passwd"
    other.write_text("root:x:0:0::/root:/bin/sh\n")
    with pytest.raises(ValueError, match="is not a model"):
        load_model(other, torch.float32, "cpu", progress=False)


def test_engine_settings_a_machine_cannot_run():
    from kvfence.engine.config import EngineConfig

    with pytest.raises(ValueError, match="device must be cpu, cuda, cuda:N or auto"):
        EngineConfig(device="tpu").resolved_device()
    with pytest.raises(ValueError, match="threads must be at most 4 x"):
        EngineConfig(num_threads=100000)


def _launch_pd_run() -> int:
    """launch-pd's supervising loop, with the signal handlers it installs put back after."""
    import signal

    from kvfence.pd import launch

    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        return launch._run(build_parser().parse_args(["launch-pd"]), {}, "/s")
    finally:
        for sig, h in handlers.items():
            signal.signal(sig, h)


def test_launch_pd_refuses_before_starting_and_never_restarts_a_refusal(tmp_path, monkeypatch):
    from kvfence.pd import launch

    a = build_parser().parse_args(["launch-pd", "--port", "65534"])
    with pytest.raises(ValueError, match="past 65535"):
        launch.node_commands(a, "/s")
    bad = tmp_path / "t.toml"
    bad.write_text("[tenants.a]\napi_keys = ['short']\n")
    from kvfence.server.tenants import TenantsFileError

    with pytest.raises(TenantsFileError):
        launch.launch_pd(build_parser().parse_args(["launch-pd", "--port", "18150", "--tenants", str(bad)]))
    # a node that refuses its configuration (exit 2) stops the cluster at once: started again, it
    # would refuse again (a probe saw three restarts of each node on a bad tenants file)
    started: list[str] = []
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)", "--port", "1"]
    refuser = [sys.executable, "-c", "import sys; sys.exit(2)", "--port", "2"]
    monkeypatch.setattr(launch, "node_commands", lambda a, s: {"prefill": sleeper, "decode": refuser,
                                                              "router": sleeper})
    real_start = launch.start_child

    def start(cmd, **kw):
        started.append("refuser" if cmd is refuser else "sleeper")
        return real_start(cmd, **kw)

    monkeypatch.setattr(launch, "start_child", start)

    assert _launch_pd_run() == 2
    assert started.count("refuser") == 1
    # one that listened first and then exited 2 failed while serving: restarted, as any crash is
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]
    server = [sys.executable, "-c", "import socket, sys, time; s = socket.socket(); "
              f"s.bind(('127.0.0.1', {free})); s.listen(); time.sleep(1.2); sys.exit(2)", "--port", str(free)]
    started.clear()
    monkeypatch.setattr(launch, "node_commands", lambda a, s: {"prefill": sleeper, "decode": server,
                                                              "router": sleeper})
    monkeypatch.setattr(launch, "start_child", lambda cmd, **kw: (
        started.append("server" if cmd is server else "sleeper"), real_start(cmd, **kw))[1])
    assert _launch_pd_run() == 2
    assert started.count("server") == 1 + launch.MAX_RESTARTS


def test_messages_that_name_what_is_wrong(tmp_path, capsys):
    from kvfence.kv.pool import parse_bytes
    from kvfence.pd.tls import TlsSettings, check_node_url

    with pytest.raises(ValueError, match="'garbage' is not an http:// or https:// URL"):
        check_node_url("garbage", TlsSettings())
    assert parse_bytes("1TiB") == 1 << 40
    missing = tmp_path / "ca.crt"
    assert main(["probe", "--port", "1", "--tls-ca", str(missing)]) == 1
    assert f"cannot use --tls-ca {missing}" in capsys.readouterr().err


def test_launch_pd_stops_the_router_before_the_nodes(tmp_path, monkeypatch):
    """The router ends its requests in flight with a 503 by its --shutdown-timeout; stopped with
    the nodes and killed at their grace, it cut its clients off with no word."""

    from kvfence.pd import launch

    log = tmp_path / "stops.log"

    def child(name: str, exit_code: int | None = None, linger: float = 0.0) -> list[str]:
        code = (f"import signal, sys, time\n"
                f"def stop(*_):\n"
                f"    open({str(log)!r}, 'a').write(f'{name} %f\\n' % time.time()); time.sleep({linger}); sys.exit(0)\n"
                f"signal.signal(signal.SIGTERM, stop)\n"
                # the refusal comes once every child has its handler
                + (f"time.sleep(1.5); sys.exit({exit_code})\n" if exit_code is not None else "time.sleep(60)\n"))
        return [sys.executable, "-c", code, "--port", "1"]

    router = child("router", linger=1.0)   # takes a second to end its requests
    monkeypatch.setattr(launch, "node_commands", lambda a, s: {"prefill": child("prefill"),
                                                              "decode": child("decode", exit_code=2),
                                                              "router": router})
    assert _launch_pd_run() == 2
    stops = dict(line.split() for line in log.read_text().splitlines())
    assert float(stops["prefill"]) >= float(stops["router"]) + 1.0, stops   # after the router had exited


def test_launch_pd_restarts_drains_forgives_old_failures_and_leaves_one_failing_node_stopped():
    """A fleet probe: the 4th exit of one node in the cluster's life, a clean drain included,
    stopped the router and every healthy node. Now a drain (exit 0 after listening) is
    restarted as often as it comes; failures count in a row and are forgiven once a node has
    listened HEALTHY_S (loading does not count); a node past MAX_RESTARTS is left stopped while
    another of its role listens; the last of its role, or the router, still stops everything."""
    from kvfence.pd.launch import HEALTHY_S, MAX_RESTARTS, RestartPolicy

    p = RestartPolicy(["prefill", "decode", "decode-2", "router"])
    for name in p.names:
        p.listening(name, 0.0)

    def fails(name: str, code: int = 70) -> str:
        return p.on_exit(name, code, p.exited(name))

    for i in range(10):   # the drains of a rolling restart
        assert p.on_exit("decode", 0, p.exited("decode")) == "restart"
        p.listening("decode", 10.0 * i)
    for i in range(MAX_RESTARTS):   # failing again and again, each soon after it listened
        assert fails("decode") == "restart", i
        p.listening("decode", 200.0 + i)
    assert fails("decode") == "leave"                 # decode-2 listens: only this one stops
    for _ in range(MAX_RESTARTS):                     # decode-2 fails while it loads, each time
        assert fails("decode-2", 137) == "restart"
    assert fails("decode-2", 137) == "stop"           # no decode node would be left
    # a failure long after the last is a first failure again; a slow model load is not serving
    q = RestartPolicy(["prefill", "decode", "router"])
    q.listening("decode", 0.0)
    for i in range(MAX_RESTARTS * 3):
        assert q.on_exit("prefill", 137, q.exited("prefill")) == "restart", i
        t = i * 1000.0
        q.listening("prefill", t + 90)                # listening only after a 90 s load
        q.listening("prefill", t + 90 + HEALTHY_S)
    for _ in range(MAX_RESTARTS):                     # each time it listens, then fails within a second
        q.listening("prefill", 5000.0)
        q.listening("prefill", 5001.0)
        assert q.on_exit("prefill", 70, q.exited("prefill")) == "restart"
    q.listening("prefill", 6000.0)
    assert q.on_exit("prefill", 70, q.exited("prefill")) == "stop"
    # exit 0 before it ever listened is no drain; a refusal to start is not retried
    r = RestartPolicy(["prefill", "prefill-2", "decode", "router"])
    assert r.on_exit("prefill", 0, listened=False) == "restart" and r.failures["prefill"] == 1
    assert r.on_exit("prefill", 2, listened=False) == "stop"         # prefill-2 is not listening yet
    r.listening("prefill-2", 1.0)
    assert r.on_exit("prefill", 2, listened=False) == "leave"        # now it serves
    assert r.on_exit("router", 0, listened=True) == "stop"


def test_launch_pd_passes_its_shutdown_timeout_to_every_process():
    """It refused the flag (a fleet probe): the router always had 25 s, the nodes' drain 600 s."""
    from kvfence.pd import launch

    a = build_parser().parse_args(["launch-pd", "--prefill", "2", "--shutdown-timeout", "7"])
    for name, cmd in launch.node_commands(a, "/s").items():
        i = cmd.index("--shutdown-timeout")
        assert float(cmd[i + 1]) == 7, name
        assert build_parser().parse_args(cmd[3:]).shutdown_timeout == 7   # serve takes it as given
    assert launch.router_stop_s(a) == 7 + launch.BACKSTOP_S + 5
    a = build_parser().parse_args(["launch-pd", "--prefill-routing", "round-robin", "--max-body-bytes", "4096"])
    router = build_parser().parse_args(launch.node_commands(a, "/s")["router"][3:])
    assert router.prefill_routing == "round-robin" and router.max_body_bytes == 4096
    assert "--shutdown-timeout" not in launch.node_commands(build_parser().parse_args(["launch-pd"]), "/s")["router"]


def test_launch_pd_leaves_a_failing_node_stopped_and_serves_on(monkeypatch, capsys):
    """The supervising loop itself: a decode node that keeps failing is started 1 + MAX_RESTARTS
    times, then left stopped while the other decode node listens; the cluster runs on until
    the router exits."""
    import socket

    from kvfence.pd import launch

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)", "--port", "1"]
    server = [sys.executable, "-c", "import socket, time; s = socket.socket(); "
              f"s.bind(('127.0.0.1', {free})); s.listen(); time.sleep(60)", "--port", str(free)]
    failing = [sys.executable, "-c", "import sys; sys.exit(70)", "--port", "2"]
    router = [sys.executable, "-c", "import time; time.sleep(8)", "--port", "3"]
    cmds = {"prefill": sleeper, "decode": server, "decode-2": failing, "router": router}
    monkeypatch.setattr(launch, "node_commands", lambda a, s: cmds)
    started: list[str] = []
    real_start = launch.start_child

    def start(cmd, **kw):
        started.append(next(n for n, c in cmds.items() if c is cmd))
        return real_start(cmd, **kw)

    monkeypatch.setattr(launch, "start_child", start)
    assert _launch_pd_run() == 1   # the router's exit (code 0) stops it, as a failure
    assert started.count("decode-2") == 1 + launch.MAX_RESTARTS and started.count("decode") == 1, started
    err = capsys.readouterr().err
    assert "decode-2 exited with code 70, failing 4 times in a row; left stopped" in err, err
    assert "router exited with code 0; stopping the others" in err, err


@pytest.mark.parametrize("argv", [["--help"], ["serve", "--role", "prefill"], ["secret", "new", "{tmp}/c.secret"]])
def test_what_loads_no_model_does_not_import_torch(argv, tmp_path):
    """`kvfence --help`, a refused start (here: no cluster secret) and `kvfence secret new` answer in
    ~0.6 s, not after torch's ~1 s import that the package once did on `import kvfence`."""
    import os
    import subprocess

    code = ("import sys, runpy; sys.argv = ['kvfence'] + sys.argv[1:]\n"
            "try:\n    runpy.run_module('kvfence.cli', run_name='__main__')\nexcept SystemExit as e:\n"
            "    print('exit', e.code)\nprint('torch' in sys.modules)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVFENCE_CLUSTER_SECRET")}
    r = subprocess.run([sys.executable, "-c", code, *(a.format(tmp=tmp_path) for a in argv)], capture_output=True,
                       text=True, timeout=60, env=env)
    lines = r.stdout.strip().splitlines()
    assert lines[-2] == ("exit 0" if argv[0] != "serve" else "exit 2") and lines[-1] == "False", (r.stdout, r.stderr)


def test_the_lazy_api_lists_and_resolves_its_names():
    """`dir(kvfence)` offers the API's names (editors complete from it) and not the module's helpers; each
    name resolves to the class it names, and a misspelt one is an AttributeError, not None."""
    import kvfence

    names = dir(kvfence)
    assert set(kvfence.__all__) <= set(names) and "__version__" in names, names
    assert not [n for n in names if n.startswith("_") and not n.startswith("__")], names
    for name in kvfence.__all__:
        assert getattr(kvfence, name).__name__ == name
    with pytest.raises(AttributeError, match="no attribute 'LLMs'"):
        kvfence.LLMs  # noqa: B018


@pytest.mark.parametrize("env, args, kernels", [({"KVFENCE_CACHE_DIR": "{file}"}, [], "unavailable"),
                                                ({"KVFENCE_KERNELS": "0"}, [], "off"),
                                                ({}, ["--page-size", "128"], "unsupported")])
def test_info_says_when_the_model_runs_without_its_kernels(tmp_path, env, args, kernels):
    """A kernels folder this process cannot use (here a file stands where the folder should be, as
    root's ~/.cache stood for the image's unprivileged user) leaves the model on plain torch ops:
    `kvfence info` (and the node's facts, metrics and alert) say `unavailable`, with the log's
    warning; turned off on purpose it is `off`; pages past the kernels' 64 tokens, `unsupported`."""
    import json
    import os
    import subprocess

    (tmp_path / "file").write_text("not a folder")
    extra = {k: v.format(file=tmp_path / "file") for k, v in env.items()}
    cmd = [sys.executable, "-m", "kvfence.cli", "info", "--kv-cache-memory", "8MiB", "--clamp-context", *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, **extra})
    assert r.returncode == 0, r.stderr
    facts = json.loads(r.stdout)
    assert (facts["kernels"], facts["compute"]) == (kernels, "torch ops"), facts
    assert ("CPU kernels unavailable" in r.stderr and "KVFENCE_CACHE_DIR" in r.stderr) == (kernels == "unavailable")


def test_an_incident_log_that_cannot_be_opened_says_where_and_what_to_do(tmp_path):
    """As in a pod whose user has no home: the start is refused (no log, no serving) with the path
    and the two ways to give it one, not a bare '[Errno 13] Permission denied: /nonexistent'."""
    import os
    import subprocess

    (tmp_path / "file").write_text("not a folder")
    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path / "file")}
    r = subprocess.run([sys.executable, "-m", "kvfence.cli", "serve", "--port", "18999"], capture_output=True,
                       text=True, timeout=60, env=env)
    assert r.returncode == 2, r.stderr
    assert f"cannot open the incident log {tmp_path / 'file'}/kvfence/incidents-single-18999.jsonl" in r.stderr
    assert "--incident-log PATH" in r.stderr and "XDG_STATE_HOME" in r.stderr and "Traceback" not in r.stderr
