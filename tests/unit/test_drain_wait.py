"""`kvfence drain --wait`: when the drained node counts as done, and what it prints meanwhile.
The node's answers are scripted here; tests/pd/test_fleet.py runs the command against a real
fleet's rolling restart."""
from __future__ import annotations

import time
import types

import httpx
import pytest
from test_fleet_routing import info

from kvfence import cli


def _script(*answers):
    """call() for _wait_for_drain: each answer in turn (the last repeats): a NodeInfo (200), a
    status code, or an exception to raise."""
    seq = list(answers)

    def call(method: str, path: str) -> httpx.Response:
        assert (method, path) == ("GET", "/info")
        a = seq.pop(0) if len(seq) > 1 else seq[0]
        if isinstance(a, Exception):
            raise a
        if isinstance(a, int):
            return httpx.Response(a, json={"error": {"code": "not_ready"}})
        return httpx.Response(200, json=a.to_json())
    return call


@pytest.fixture(autouse=True)
def clock(monkeypatch) -> types.SimpleNamespace:
    """cli's own `time`, with sleep a no-op (and monotonic scripted by a test). Patching the
    time module itself changed it for every thread in the process: in the whole suite the
    session's live servers' event loops read the scripted clock, used it up (StopIteration in
    their loops, this test failing) and their threads then hung the session's teardown."""
    own = types.SimpleNamespace(**{k: getattr(time, k) for k in dir(time) if not k.startswith("_")})
    own.sleep = lambda s: None
    monkeypatch.setattr(cli, "time", own)
    return own


def _draining(running: int, boot: str = "b1"):
    return info(boot=boot, draining=True, snapshot={"running": running, "waiting": 0, "pages_owned": 3 * running,
                                                   "draining": True, "violations": {}})


def test_done_when_the_node_stops_answering(capsys):
    call = _script(_draining(2), _draining(1), _draining(1), httpx.ConnectError("refused"))
    assert cli._wait_for_drain(call, "b1", 60) == 0
    out = capsys.readouterr().out
    assert "2 running" in out and "1 running" in out and "the node has exited" in out
    assert out.count("1 running") == 1   # printed when it changes, not every poll


def test_done_when_its_successor_answers(capsys):
    assert cli._wait_for_drain(_script(_draining(1), _draining(0, boot="b2")), "b1", 60) == 0
    assert "successor (boot b2) is ready" in capsys.readouterr().out


def test_an_error_answer_is_not_an_exit(capsys, clock):
    """A node opens its port only once loaded, so a 503 is not its successor loading: the drained
    node's own engine failed, or its connection cap refused the call. Said, asked again, and a
    failure at the deadline (a review: it was taken for the successor, exit 0)."""
    ticks = iter(range(0, 1000, 7))
    clock.monotonic = lambda: float(next(ticks))
    assert cli._wait_for_drain(_script(_draining(1), 503), "b1", 20) == 1
    captured = capsys.readouterr()
    assert "the node answered HTTP 503" in captured.out and "exited" not in captured.out


def test_a_slow_answer_is_not_an_exit_and_the_deadline_is_a_failure(capsys, clock):
    ticks = iter(range(0, 1000, 7))
    clock.monotonic = lambda: float(next(ticks))
    call = _script(_draining(3), httpx.ReadTimeout("slow"), _draining(3))
    assert cli._wait_for_drain(call, "b1", 20) == 1
    captured = capsys.readouterr()
    assert "exited" not in captured.out and "still draining after 20 s (--wait): 3 running" in captured.err
