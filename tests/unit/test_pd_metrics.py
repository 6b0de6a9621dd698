"""A PD node's handoff counters exist from the start at 0, so that Prometheus sees the first
one that moves (increase() over a series that first appears at 1 is 0: the alert on a
transfer that failed verification would miss the first)."""
from kvfence.server.metrics import ROLE_EVENTS, _pd_metrics


def _events(pd: dict) -> dict[str, float]:
    (family,) = [f for f in _pd_metrics(pd) if f.name == "kvfence_pd_events"]
    return {s.labels["event"]: s.value for s in family.samples}


def test_a_fresh_decode_node_reports_every_event_of_its_role_at_zero():
    events = _events({"role": "decode", "buffer_rows": 8, "buffer_free": 8, "buffer_fenced": 0})
    assert events == {e: 0.0 for e in ROLE_EVENTS["decode"]} and events["verify_failed"] == 0.0


def test_counts_replace_the_zeros_and_events_outside_the_list_still_show():
    events = _events({"role": "prefill", "pd_held": 3, "pd_fences_lifted_by_word": 1})
    assert events == {"held": 3.0, "released": 0.0, "leases_expired": 0.0, "fences": 0.0,
                      "fences_lifted_by_word": 1.0}


def test_the_seeded_events_are_the_ones_each_role_counts():
    """ROLE_EVENTS restates the counter names of the PD code: a renamed counter would lose its
    zero (and its alert its first count) without this."""
    import re
    from pathlib import Path

    pd = Path(__file__).resolve().parents[2] / "kvfence" / "pd"

    def counted(*files: str) -> set[str]:
        return {m for f in files for m in re.findall(r'counters\["([a-z_]+)"\] \+= 1', (pd / f).read_text())}

    assert set(ROLE_EVENTS["prefill"]) <= counted("prefill.py", "link.py")
    assert set(ROLE_EVENTS["decode"]) <= counted("decode.py", "link.py")
