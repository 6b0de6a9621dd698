"""`kvfence probe live|ready` (the Kubernetes exec probe) answers 0 for a live or ready
server, 1 for a port where nothing answers, and 1 for ready while the engine is not ready."""
from __future__ import annotations

import threading

from kvfence.cli import main
from kvfence.procs import free_ports


def test_probe_says_live_and_ready_for_a_serving_server(single):
    assert main(["probe", "live", "--port", str(single.port)]) == 0
    assert main(["probe", "ready", "--port", str(single.port)]) == 0


def test_probe_fails_where_nothing_answers():
    assert main(["probe", "live", "--port", str(free_ports(1)), "--timeout", "1"]) == 1


def test_probe_ready_fails_while_the_engine_is_loading(make_server):
    gate = threading.Event()
    srv = make_server(tenants=None, gate=gate, wait=False)
    try:
        assert main(["probe", "live", "--port", str(srv.port)]) == 0      # loading counts as alive
        assert main(["probe", "ready", "--port", str(srv.port)]) == 1
        assert main(["probe", "--port", str(srv.port)]) == 1               # no argument: ready
    finally:
        gate.set()


def test_bench_url_without_the_key_a_server_wants_says_so_in_one_line(server, capsys):
    """Found by a walkthrough: kvfence bench --url against a server with a tenants file and no
    --api-key died with a traceback from /v1/models' 401."""
    assert main(["bench", "--url", server.url, "--num-requests", "1", "--output-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert "--api-key" in err and "Traceback" not in err
