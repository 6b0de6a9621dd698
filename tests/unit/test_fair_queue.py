"""The schema checks' worker: tenants take turns, so a tenant with many slow calls waiting
delays another tenant's call by at most the one running (found by a docs probe: three
costly schemas of one key held a fourth request 5.3 s in arrival order)."""
from __future__ import annotations

import threading

import pytest

from kvfence.server.fair_queue import FairWorker


def _gated(worker: FairWorker, order: list[str]):
    gate, running = threading.Event(), threading.Event()

    def first_call():
        running.set()
        gate.wait(10)
        order.append("alice-0")

    first = worker.submit("alice", first_call)
    assert running.wait(10)
    return gate, first


def test_a_tenant_that_arrives_later_goes_before_the_rest_of_one_tenants_queue():
    w, order = FairWorker("test-fair"), []
    gate, first = _gated(w, order)
    rest = [w.submit("alice", lambda i=i: order.append(f"alice-{i}")) for i in (1, 2, 3)]
    bob = w.submit("bob", lambda: order.append("bob-0"))
    carol = [w.submit("carol", lambda i=i: order.append(f"carol-{i}")) for i in (0, 1)]
    assert w.waiting() == {"alice": 3, "bob": 1, "carol": 2}
    gate.set()
    for f in [first, *rest, bob, *carol]:
        f.result(10)
    assert order == ["alice-0", "bob-0", "carol-0", "alice-1", "carol-1", "alice-2", "alice-3"]


def test_results_errors_and_cancelled_calls():
    w, order = FairWorker("test-fair-2"), []
    gate, first = _gated(w, order)
    skipped = w.submit("bob", lambda: order.append("never"))
    failing = w.submit("carol", lambda: 1 / 0)
    answer = w.submit("carol", lambda: 42)
    assert skipped.cancel()
    gate.set()
    assert answer.result(10) == 42 and first.result(10) is None
    with pytest.raises(ZeroDivisionError):
        failing.result(10)
    assert order == ["alice-0"] and w.waiting() == {}


def test_a_worker_that_could_not_start_is_started_by_the_next_call(monkeypatch):
    # found in review: the thread was kept before start(); one failed start hung every later call
    w, real = FairWorker("test-fair-3"), threading.Thread.start
    monkeypatch.setattr(threading.Thread, "start", lambda self: (_ for _ in ()).throw(RuntimeError("no threads")))
    with pytest.raises(RuntimeError, match="no threads"):
        w.submit("alice", lambda: 1)
    assert w.waiting() == {}          # the failed call was not left queued
    monkeypatch.setattr(threading.Thread, "start", real)
    assert w.submit("alice", lambda: 2).result(10) == 2
