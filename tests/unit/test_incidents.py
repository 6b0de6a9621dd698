"""The incident log (kvfence/incidents.py): records, the hash chain and its verification,
and the disclosure report (kvfence/disclosure.py); the operator's sections of the tenants
file."""
from __future__ import annotations

import json

import pytest

from kvfence import disclosure, incidents
from kvfence.server.tenants import TenantRegistry, TenantsFileError


def _log(tmp_path, role="decode"):
    return incidents.IncidentLog(tmp_path / "incidents.jsonl", role, boot_id="boot-1")


def test_records_chain_and_a_reopened_log_continues_the_chain(tmp_path):
    log = _log(tmp_path)
    a = log.record("ledger_refusal", invariant="I2", request_id="r1", tenant="alice", involved=["bob"], pages=[7],
                   client=incidents.client_outcome("isolation_violation", 3), detail="page 7 is owned")
    assert a["prev"] == incidents.GENESIS and a["client"] == {"status": 500, "code": "isolation_violation",
                                                              "tokens_streamed": 3}
    log.close()
    again = incidents.IncidentLog(tmp_path / "incidents.jsonl", "decode", boot_id="boot-2")
    b = again.record("fence_lifted_by_time", request_id="r2", tenant="bob", involved=["bob"], rows=[3, 1])
    again.close()
    assert b["prev"] != incidents.GENESIS and b["rows"] == [1, 3] and b["invariant"] == "I6"
    v = incidents.verify(tmp_path / "incidents.jsonl")
    assert v.ok and v.records == 2
    with pytest.raises(ValueError):
        _log(tmp_path).record("made_up")


@pytest.mark.parametrize("tamper", ["edit", "delete", "insert", "garbage"])
def test_verify_finds_where_the_chain_breaks(tmp_path, tamper):
    log = _log(tmp_path)
    for i in range(4):
        log.record("ledger_refusal", request_id=f"r{i}", tenant="alice", involved=["alice"], pages=[i + 1])
    log.close()
    path = tmp_path / "incidents.jsonl"
    lines = path.read_bytes().splitlines(keepends=True)
    if tamper == "edit":       # someone rewrites which tenant's data was involved
        rec = json.loads(lines[1])
        rec["involved_tenants"] = []
        lines[1] = (json.dumps(rec, sort_keys=True, separators=(",", ":")) + "\n").encode()
        where = 3   # line 2 re-serialized keeps its own prev; line 3's prev no longer matches
    elif tamper == "delete":
        del lines[1]
        where = 2
    elif tamper == "insert":
        lines.insert(2, lines[0])
        where = 3
    else:
        lines[2] = b"not json\n"
        where = 3
    path.write_bytes(b"".join(lines))
    v = incidents.verify(path)
    assert not v.ok and v.broken_at == where, v.message


def test_no_log_open_means_record_is_a_no_op():
    incidents.close_log()
    assert incidents.record("faults_active", detail="x") is None


def _events(tmp_path):
    log = _log(tmp_path)
    log.record("ledger_refusal", invariant="I2", request_id="r1", tenant="alice", involved=["bob"], pages=[7],
               client=incidents.client_outcome("isolation_violation", 2))
    log.record("transfer_verification_failed", request_id="r2", tenant="carol", involved=["carol"], rows=[4],
               client=incidents.client_outcome("kv_verification_failed", 0))
    log.record("node_refused", detail="prefill node http://10.0.0.5:8001: advertised context exceeds")
    log.close()
    return tmp_path / "incidents.jsonl"


def test_the_report_names_requesters_and_owners_and_answers_no(tmp_path):
    rep = disclosure.build([_events(tmp_path)], disclosure={"contact": "sec@example.com"})
    assert rep["disclosure"]["contact"] == "sec@example.com"
    t = rep["tenants"]
    assert t["alice"]["as_requester"] == ["r1"] and t["alice"]["as_owner"] == []
    assert t["bob"]["as_owner"] == ["r1"] and t["bob"]["as_requester"] == []
    assert t["carol"]["as_requester"] == ["r2"] == t["carol"]["as_owner"]
    assert [c["data_of"] for c in rep["cross_tenant"]] == [["bob"]]
    assert rep["cross_tenant"][0]["reached_client"] is False
    assert "before the forward pass ran" in rep["cross_tenant"][0]["how_we_know"]
    assert rep["answer"]["any_byte_computed_over_another_tenants_data_reached_a_client"] == "no"
    assert [p["kind"] for p in rep["process_events"]] == ["node_refused"]
    only_bob = disclosure.build([tmp_path / "incidents.jsonl"], tenant="bob")
    assert list(only_bob["tenants"]) == ["bob"] and len(only_bob["cross_tenant"]) == 1
    text = disclosure.render(rep)
    assert "sec@example.com" in text and "reach a client? no" in text


def test_a_200_after_a_cross_tenant_refusal_is_a_yes(tmp_path):
    log = _log(tmp_path)
    log.record("ledger_refusal", request_id="r1", tenant="alice", involved=["bob"], pages=[7],
               client={"status": 200, "code": None, "tokens_streamed": 5})
    log.close()
    rep = disclosure.build([tmp_path / "incidents.jsonl"])
    assert rep["answer"]["any_byte_computed_over_another_tenants_data_reached_a_client"] == "yes"
    assert rep["tenants"]["bob"]["bytes_reached_a_client"] is True


def test_the_report_cli_filters_by_time_and_fails_on_a_broken_chain(tmp_path, capsys):
    from kvfence.cli import main
    path = _events(tmp_path)
    assert main(["incidents", str(path), "--json", "--since", "2000-01-01"]) == 0
    assert json.loads(capsys.readouterr().out)["events"] == 3
    assert main(["incidents", str(path), "--json", "--until", "2000-01-01"]) == 0
    assert json.loads(capsys.readouterr().out)["events"] == 0
    assert main(["incidents", "--verify", str(path)]) == 0
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(lines[0] + lines[2])
    assert main(["incidents", "--verify", str(path)]) == 1
    assert "BROKEN" in capsys.readouterr().out
    assert main(["incidents", str(path)]) == 1          # the report says so and fails too
    out = capsys.readouterr().out
    # a removed line may have been the one that said yes (found by an operator walkthrough: "no")
    assert "CHAIN BROKEN" in out and "reach a client? cannot tell" in out, out


def test_the_operator_sections_of_the_tenants_file():
    base = {"tenants": {"alice": {"api_keys": ["sk-alice-123"]}}}
    reg = TenantRegistry.from_dict({**base, "operator": {"api_keys": ["op-key-12345"]},
                                    "disclosure": {"contact": "sec@example.com", "notification_window_hours": 72}})
    assert reg.is_operator("Bearer op-key-12345")
    assert not reg.is_operator("Bearer sk-alice-123") and not reg.is_operator(None)
    assert reg.disclosure["notification_window_hours"] == 72
    assert not TenantRegistry.single().is_operator("Bearer anything")
    for bad in ({"operator": {"api_keys": ["sk-alice-123"]}}, {"operator": {"api_keys": []}},
                {"operator": {"keys": ["x"]}}, {"disclosure": {"contact": ""}},
                {"disclosure": {"notification_window_hours": 0}}, {"disclosure": {"phone": "1"}}):
        with pytest.raises(TenantsFileError):
            TenantRegistry.from_dict({**base, **bad})


def test_a_write_cut_short_is_named_torn_and_the_next_boot_chains_on_from_it(tmp_path):
    # found in review: a half-written last line made the report crash, and the next boot's
    # first record was glued onto it
    path = tmp_path / "incidents.jsonl"
    log = _log(tmp_path)
    log.record("ledger_refusal", request_id="r1", tenant="alice", involved=["bob"], pages=[7])
    log.record("ledger_refusal", request_id="r2", tenant="alice", involved=["bob"], pages=[8])
    log.close()
    data = path.read_bytes()
    path.write_bytes(data[:-40])                       # the process died in the middle of r2's line
    v = incidents.verify(path)
    assert v.ok and v.records == 1 and v.torn == (2,) and "cut short" in v.message
    assert [r["request_id"] for r in incidents.read(path)] == ["r1"]
    again = incidents.IncidentLog(path, "decode", boot_id="boot-2")
    again.record("ledger_refusal", request_id="r3", tenant="carol", involved=["carol"], pages=[9])
    again.close()
    assert len(path.read_bytes().splitlines()) == 3     # r3 on its own line
    v = incidents.verify(path)
    assert v.ok and v.records == 2 and v.torn == (2,), v.message
    rep = disclosure.build([path])
    assert [c["request_id"] for c in rep["cross_tenant"]] == ["r1"] and "carol" in rep["tenants"]
    assert rep["logs"][0]["torn_lines"] == [2] and "cut short" in rep["answer"]["how_we_know"]
    # what the torn line recorded is lost, so the report cannot say no (found in review)
    assert rep["answer"]["any_byte_computed_over_another_tenants_data_reached_a_client"] == "cannot tell"
    assert "bytes reached a client: cannot tell" in disclosure.render(rep)
    # garbage put in by hand, with nothing chaining on from it, is still a break, and the
    # report shows what came before it instead of crashing
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(lines[0] + b"{not json\n" + lines[2])
    v = incidents.verify(path)
    assert not v.ok and v.broken_at == 2
    rep = disclosure.build([path])
    assert [c["request_id"] for c in rep["cross_tenant"]] == ["r1"] and not rep["logs"][0]["intact"]


def test_an_anchored_last_hash_catches_a_rewritten_or_cut_off_end(tmp_path, capsys):
    from kvfence.cli import main
    path = _events(tmp_path)
    anchored = incidents.verify(path).last_hash
    assert main(["incidents", "--verify", "--expect-last-hash", anchored, str(path)]) == 0
    lines = path.read_bytes().splitlines(keepends=True)
    rec = json.loads(lines[-1])                        # the last line, edited: the unkeyed chain still holds
    rec["detail"] = "nothing happened"
    path.write_bytes(b"".join(lines[:-1]) + (json.dumps(rec, sort_keys=True, separators=(",", ":")) + "\n").encode())
    assert incidents.verify(path).ok
    capsys.readouterr()
    assert main(["incidents", "--verify", "--expect-last-hash", anchored, str(path)]) == 1
    assert "never reaches the expected" in capsys.readouterr().out
    path.write_bytes(b"".join(lines[:-1]))             # cut off
    assert main(["incidents", "--expect-last-hash", anchored, str(path)]) == 1
    assert main(["incidents", "--expect-last-hash", anchored, str(path), str(path)]) == 2


def test_a_public_prefix_scope_is_reported_as_a_scope_not_as_a_tenant(tmp_path):
    # found in review: the ledger's key for a public scope ("\0public:NAME") reached the report
    # as a tenant whose name starts with a NUL
    from kvfence.kv.ledger import PUBLIC_SCOPE, BlockTable, Ledger, Owner

    led = Ledger(16, 4)
    docs = led.tenant_id(f"{PUBLIC_SCOPE}docs")
    p, t = Owner(led.tenant_id("bob"), 1, scope=docs), BlockTable()
    led.allocate(p, 1, t)
    led.mark_written(p, t, 0, 4)
    assert led.publish(p, t.pages[0], t.epochs[0])
    owner = led.page_owner(t.pages[0])
    log = _log(tmp_path)
    log.record("ledger_refusal", request_id="r1", tenant="alice", involved=[owner], pages=[t.pages[0]])
    log.close()
    rep = disclosure.build([tmp_path / "incidents.jsonl"])
    assert "\0" not in json.dumps(rep) and rep["tenants"]["public:docs"]["kind"] == "public_prefix_scope"
    assert rep["tenants"]["alice"]["kind"] == "tenant"
    assert "public prefix scope docs" in disclosure.render(rep)


def test_an_anchor_taken_earlier_still_checks_a_log_that_grew_since(tmp_path, capsys):
    # found in review: the anchor had to be the log's hash *now*, so one more incident after
    # the operator wrote it down made --expect-last-hash fail a log nobody touched
    from kvfence.cli import main
    path = tmp_path / "incidents.jsonl"
    log = _log(tmp_path)
    log.record("ledger_refusal", request_id="r1", tenant="alice", involved=["bob"], pages=[7])
    anchored = log.last_hash
    log.record("ledger_refusal", request_id="r2", tenant="alice", involved=["bob"], pages=[8])
    log.close()
    v = incidents.verify(path, anchored)
    assert v.ok and "line 1" in v.message, v.message
    assert incidents.verify(path, incidents.GENESIS).ok          # anchored while the log was empty
    assert main(["incidents", "--verify", "--expect-last-hash", anchored, str(path)]) == 0
    # the anchored line edited: the chain no longer passes through the anchor
    lines = path.read_bytes().splitlines(keepends=True)
    rec = json.loads(lines[0])
    rec["involved_tenants"] = []
    first = (json.dumps(rec, sort_keys=True, separators=(",", ":")) + "\n").encode()
    second = json.loads(lines[1])
    second["prev"] = incidents._line_hash(first)              # and the chain rebuilt after it
    path.write_bytes(first + (json.dumps(second, sort_keys=True, separators=(",", ":")) + "\n").encode())
    assert incidents.verify(path).ok
    v = incidents.verify(path, anchored)
    assert not v.ok and "never reaches the expected" in v.message, v.message
    capsys.readouterr()
    assert main(["incidents", "--verify", "--expect-last-hash", anchored, str(path)]) == 1


def test_a_crash_loop_leaves_several_torn_lines_and_that_is_not_tampering(tmp_path):
    # found in review: two boots in a row died mid-write; the first torn line was followed by
    # the second, not by a record, and verify called it an edit
    path = tmp_path / "incidents.jsonl"
    log = _log(tmp_path)
    log.record("ledger_refusal", request_id="r1", tenant="alice", involved=["bob"], pages=[7])
    log.close()
    for boot in ("b2", "b3"):
        again = incidents.IncidentLog(path, "decode", boot_id=boot)
        again.record("ledger_refusal", request_id=f"lost-{boot}", tenant="alice", involved=["bob"], pages=[8])
        again.close()
        path.write_bytes(path.read_bytes()[:-30])       # died while writing it
    v = incidents.verify(path)
    assert v.ok and v.torn == (2, 3), v.message
    # a boot that ends the torn line and then writes nothing: still torn, not a break
    incidents.IncidentLog(path, "decode", boot_id="b4").close()
    v = incidents.verify(path)
    assert v.ok and v.torn == (2, 3), v.message
    anchor = incidents.IncidentLog(path, "decode", boot_id="b5")
    shown = anchor.last_hash                             # what the statement showed after the crash
    anchor.record("ledger_refusal", request_id="r9", tenant="carol", involved=["carol"], pages=[9])
    anchor.close()
    v = incidents.verify(path, shown)
    assert v.ok and v.records == 2 and v.torn == (2, 3), v.message
    # garbage put between two torn lines and the record after them: the record does not chain from it
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join(lines[:3]) + b"{inserted\n" + lines[3])
    v = incidents.verify(path)
    assert not v.ok and v.broken_at == 4, v.message     # no record's beginning: named itself


def test_a_log_written_before_scopes_were_named_reports_the_scope_by_its_name(tmp_path):
    # found in review: older logs hold the ledger's raw key "\0public:NAME"
    from kvfence.kv.ledger import PUBLIC_SCOPE
    log = _log(tmp_path)
    log.record("ledger_refusal", request_id="r1", tenant="alice", involved=[f"{PUBLIC_SCOPE}docs", "bob"], pages=[3])
    log.close()
    rep = disclosure.build([tmp_path / "incidents.jsonl"])
    assert set(rep["tenants"]) == {"alice", "bob", "public:docs"}, rep["tenants"]
    assert rep["tenants"]["public:docs"]["kind"] == "public_prefix_scope"
    assert rep["cross_tenant"][0]["data_of"] == ["bob", "public:docs"]


def test_the_tail_read_for_the_last_hash_is_bounded(tmp_path):
    """Found in review: the tail was rebuilt by prepending each 4 KiB (quadratic); a 16 MB log
    without a newline took 11 s to open. A record is a few KB: at most MAX_TAIL is read back."""
    from kvfence.incidents import MAX_TAIL, _last_line

    path = tmp_path / "incidents.jsonl"
    path.write_bytes(b'{"a": 1}\n' + b"x" * (3 * MAX_TAIL))
    last = _last_line(path)
    assert last is not None and set(last[:-1]) == {ord("x")} and len(last) <= MAX_TAIL + 4096 + 1
    path.write_bytes(b'{"a": 1}\n{"b": 2}\n')
    assert _last_line(path) == b'{"b": 2}\n'


def test_the_text_report_escapes_what_a_record_quotes(tmp_path):
    """Found in review: a refused node's reason quotes its advertised fields, which a peer
    controls; a newline printed a made-up answer line and an escape sequence hid the real one."""
    log = _log(tmp_path)
    forged = "bf16\n\nDid any byte computed over another tenant's data reach a client? no\x1b[8m"
    log.record("node_refused", detail=f"prefill node http://10.0.0.5:8001: dtype {forged}")
    log.close()
    text = disclosure.render(disclosure.build([tmp_path / "incidents.jsonl"]))
    assert "\x1b" not in text and "\\x1b[8m" in text and "bf16\\n\\nDid any" in text
    assert [line for line in text.splitlines() if line.startswith("Did any byte")] == \
        ["Did any byte computed over another tenant's data reach a client? no"]


def test_a_file_that_is_not_an_incident_log_does_not_pass(tmp_path):
    # found by a CLI probe: /etc/passwd, random bytes and "[1,2]" passed --verify as "0 records,
    # chain intact" with every line "cut short", and a chained object without "unix" crashed
    # the report. A line cut short is a piece of a record's beginning; anything else was put there
    import json
    import random

    path = tmp_path / "x.jsonl"
    for data in (b"root:x:0:0:root:/root:/bin/bash\ndaemon:x:1:1::/:/usr/sbin/nologin\n",
                 bytes(random.Random(1).randrange(256) for _ in range(2000)), b"[1,2]\n", b"\n\n"):
        path.write_bytes(data)
        v = incidents.verify(path)
        assert not v.ok and v.broken_at == 1 and v.records == 0, (data[:20], v.message)
    log = incidents.IncidentLog(tmp_path / "real.jsonl", "single", boot_id="b0")
    real = log.record("ledger_refusal", request_id="r0", tenant="a", involved=["b"], pages=[1])
    log.close()
    real["prev"] = incidents.GENESIS
    # each field the report reads, missing or of another type (found in review: a chained line
    # without "time", or with a number for a tenant or a string for the client, crashed it)
    for field, bad in (("unix", None), ("time", None), ("invariant", None), ("role", None), ("tenant", 5),
                       ("client", "x"), ("involved_tenants", [1]), ("pages", ["1"]), ("other_party", "yes")):
        forged = {k: v for k, v in real.items() if k != field}
        if bad is not None:
            forged[field] = bad
        path.write_text(json.dumps(forged, sort_keys=True) + "\n")
        v = incidents.verify(path)
        assert not v.ok and f"'{field}'" in v.message, (field, v.message)
        assert disclosure.build([path])["logs"][0]["intact"] is False      # and the report does not crash
    path.write_text(json.dumps(real, sort_keys=True) + "\n")
    assert incidents.verify(path).ok
    path.write_bytes(b"[" * 100_000 + b"\n")                             # deeper than the parser goes
    assert not incidents.verify(path).ok
    path.write_bytes(b"")
    assert incidents.verify(path).ok      # a server that never refused anything: an empty log
    log = incidents.IncidentLog(path, "single", boot_id="b1")
    log.record("ledger_refusal", request_id="r1", tenant="a", involved=["b"], pages=[1])
    log.close()
    path.write_bytes(path.read_bytes() + b'{"boot_id":"b2","cli')   # cut short: still torn
    v = incidents.verify(path)
    assert v.ok and v.torn == (2,), v.message


def test_the_command_exits_3_when_the_logs_cannot_tell_and_refuses_a_malformed_anchor(tmp_path, capsys):
    from kvfence.cli import main

    log = _log(tmp_path)
    log.record("ledger_refusal", request_id="r1", tenant="alice", involved=["bob"], pages=[7])
    log.close()
    path = tmp_path / "incidents.jsonl"
    assert main(["incidents", str(path)]) == 0
    path.write_bytes(path.read_bytes() + b'{"boot_id":"b2","cli')     # a record lost mid-write
    assert main(["incidents", "--verify", str(path)]) == 0             # the chain itself is intact
    assert main(["incidents", str(path)]) == 3                          # but the report cannot say no
    assert "cannot tell" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:                                 # a typo is not a hash never reached
        main(["incidents", "--verify", "--expect-last-hash", "zzz", str(path)])
    assert e.value.code == 2 and "not a SHA-256 hash" in capsys.readouterr().err


def test_a_process_with_fault_points_on_makes_the_answer_cannot_tell(tmp_path, capsys):
    """A docs probe: with skip_watermark on, a cross-tenant read is never refused, so never
    recorded, and the report said "no" over a faults_active record. Now a window in which such a
    process ran cannot be answered no: exit 3, naming the process and its faults. A window that
    ends before it started, or begins after a later boot took over, still can."""
    import time

    from kvfence.cli import main

    path = tmp_path / "incidents.jsonl"
    old = incidents.IncidentLog(path, "single", boot_id="boot-old")
    old.record("faults_active", detail="test fault points on: skip_watermark")
    old.close()
    time.sleep(0.05)
    between = time.time()
    time.sleep(0.05)
    new = incidents.IncidentLog(path, "single", boot_id="boot-new")
    new.record("node_refused", detail="a later boot, with no faults")
    new.close()
    rep = disclosure.build([path])
    assert rep["answer"]["any_byte_computed_over_another_tenants_data_reached_a_client"] == "cannot tell"
    assert [u["boot_id"] for u in rep["unguarded"]] == ["boot-old"]
    assert main(["incidents", str(path)]) == 3
    out = capsys.readouterr().out
    assert "skip_watermark" in out and "reach a client? cannot tell" in out and "test fault points" in out, out
    after = disclosure.build([path], since=time.time() + 1)    # after the later boot took over
    assert after["answer"]["any_byte_computed_over_another_tenants_data_reached_a_client"] == "no"
    before = disclosure.build([path], until=between - 10)     # before the faulty process started
    assert before["answer"]["any_byte_computed_over_another_tenants_data_reached_a_client"] == "no"


def test_a_tenant_filter_counts_its_own_events_and_refuses_a_name_the_file_does_not_have(tmp_path, capsys):
    """A docs probe: --tenant nosuch said "no" with exit 0 and counted every event in the log."""
    from kvfence.cli import main

    path = _events(tmp_path)
    assert main(["incidents", str(path), "--json", "--tenant", "bob"]) == 0
    assert json.loads(capsys.readouterr().out)["events"] == 1
    tenants = tmp_path / "t.toml"
    tenants.write_text('[tenants.bob]\napi_keys = ["sk-bob-00000001"]\n')
    assert main(["incidents", str(path), "--tenant", "bobb", "--tenants", str(tenants)]) == 2
    assert "no such tenant" in capsys.readouterr().out
    assert main(["incidents", str(path), "--tenant", "bob", "--tenants", str(tenants)]) == 0
    assert main(["incidents", str(path), "--tenant", "dave"]) == 0   # without the file: said, not refused
    assert "appears in no record" in capsys.readouterr().out


def test_a_faulty_window_ends_when_the_next_process_opens_the_log_and_only_check_skipping_faults_count(
        tmp_path, monkeypatch):
    """Review: a faulty boot's window ended only at the next boot's first record, which a healthy
    boot may never write: every later report said "cannot tell". A process without faults that
    opens the log now ends the window (faults_cleared); and a fault that keeps every check
    running (kill_node_at, which the canary arms) leaves the answer alone."""
    import time

    from kvfence import faults

    assert faults.SKIPS_A_CHECK.isdisjoint(faults.KEEPS_THE_CHECKS)
    assert faults.SKIPS_A_CHECK | faults.KEEPS_THE_CHECKS == set(faults.FAULTS)   # a new fault must be placed

    path = tmp_path / "incidents-single-8000.jsonl"
    incidents.open_log(path, "single", boot_id="faulty", faults_on=True)
    incidents.record("faults_active", detail="test fault points on: skip_watermark")
    incidents.close_log()
    incidents.open_log(path, "single", boot_id="faulty-again", faults_on=True)   # still faulty: nothing ends
    incidents.close_log()
    assert [r["kind"] for r in incidents.read(path)] == ["faults_active"]
    time.sleep(0.05)
    incidents.open_log(path, "single", boot_id="healthy")                        # ends the window
    incidents.close_log()
    incidents.open_log(path, "single", boot_id="healthy-again")                  # nothing more to end
    incidents.close_log()
    assert [r["kind"] for r in incidents.read(path)] == ["faults_active", "faults_cleared"]
    assert incidents.verify(path).ok
    later = disclosure.build([path], since=time.time())
    assert later["answer"]["any_byte_computed_over_another_tenants_data_reached_a_client"] == "no", later
    whole = disclosure.build([path])
    assert whole["answer"]["any_byte_computed_over_another_tenants_data_reached_a_client"] == "cannot tell"

    kill = tmp_path / "incidents-decode-8002.jsonl"
    log = incidents.IncidentLog(kill, "decode", boot_id="armed")
    log.record("faults_active", detail="test fault points switched on over HTTP: kill_node_at:decode_after_pull")
    log.close()
    assert disclosure.build([kill])["answer"]["any_byte_computed_over_another_tenants_data_reached_a_client"] == "no"
