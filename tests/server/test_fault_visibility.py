"""A server with a test fault point enabled says so loudly everywhere it reports on itself:
an ERROR banner at start-up, a failed start-up check, the isolation statement and a gauge.
A server started without one says none is active."""
from __future__ import annotations

import logging

from kvfence import faults


def _checks(srv) -> dict:
    return {c["name"]: c for c in srv.engine.startup_checks}


def test_production_style_server_has_no_fault_active(server):
    assert not faults.enabled()
    c = _checks(server)["fault injection"]
    assert c["status"] == "passed" and "none active" in c["detail"]
    with server.http("alice") as h:
        st = h.get("/v1/kvfence/isolation").json()
    assert st["fault_injection"]["active"] is False and st["fault_injection"]["faults"] == []
    assert server.metric("kvfence_fault_injection_active") == 0.0


def test_server_with_a_fault_enabled_is_loud(make_server, caplog):
    # skip_row_auth is a PD fault point: harmless on a single node, but still announced
    with caplog.at_level(logging.ERROR, logger="kvfence.faults"):
        with faults.injected("skip_row_auth"):
            srv = make_server(tenants=None)
            banner = [r for r in caplog.records if r.levelno == logging.ERROR and r.name == "kvfence.faults"]
            assert banner and "FAULT INJECTION ACTIVE" in banner[0].getMessage()
            assert "skip_row_auth" in banner[0].getMessage()
            c = _checks(srv)["fault injection"]
            assert c["status"] == "failed" and c["detail"].startswith("ACTIVE (skip_row_auth)")
            with srv.http(None) as h:
                st = h.get("/v1/kvfence/isolation").json()
                assert h.get("/health").status_code == 200  # it serves: tests need it to
            assert st["fault_injection"] == {"active": True, "faults": ["skip_row_auth"],
                                             "meaning": st["fault_injection"]["meaning"]}
            assert "do NOT hold" in st["fault_injection"]["meaning"]
            assert srv.metric("kvfence_fault_injection_active") == 1.0
            assert srv.metric("kvfence_fault_injection_enabled", fault="skip_row_auth") == 1.0
        # the live view follows the setting; the start-up record keeps what start-up saw
        assert srv.metric("kvfence_fault_injection_active") == 0.0
        assert _checks(srv)["fault injection"]["status"] == "failed"
    srv.stop()
