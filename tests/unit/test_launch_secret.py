"""launch-pd's cluster secret: a fresh random one per cluster, in a file only its owner can
read, passed to the three processes by path (never the secret itself on a command line)."""
from __future__ import annotations

import argparse
import os
import stat

from kvfence.pd.launch import node_commands, write_secret_file
from kvfence.pd.seal import load_secret


def test_secret_file_is_private_random_and_loadable(tmp_path):
    a, b = write_secret_file(str(tmp_path)), write_secret_file(str(tmp_path))
    assert stat.S_IMODE(os.stat(a).st_mode) == 0o600
    sa, sb = load_secret(a, env={}), load_secret(b, env={})
    assert len(sa) >= 32 and sa != sb


def test_node_commands_pass_the_path_not_the_secret(tmp_path):
    path = write_secret_file(str(tmp_path))
    secret = load_secret(path, env={}).decode()
    a = argparse.Namespace(port=8000, host="127.0.0.1", threads=None, tenants=None, model=None, max_model_len=None,
                           clamp_context=False, served_model_name=None, verbose=False, cluster_secret_file=None)
    cmds = node_commands(a, path)
    assert set(cmds) == {"prefill", "decode", "router"}
    for cmd in cmds.values():
        assert cmd[cmd.index("--cluster-secret-file") + 1] == path
        assert not any(secret in part for part in cmd)


def _launch_args(**kw) -> argparse.Namespace:
    from kvfence.cli import build_parser

    return build_parser().parse_args(["launch-pd", *kw.pop("argv", [])])


def test_launch_pd_passes_every_engine_switch_to_the_nodes(tmp_path):
    # found in review: --audit-reads and --max-waiting were dropped, so a launch-pd cluster ran
    # without the read audit its operator asked for
    a = _launch_args(argv=["--audit-reads", "--max-waiting", "64", "--clamp-context", "--scrub", "poison"])
    cmds = node_commands(a, str(tmp_path / "s"))
    for role in ("prefill", "decode"):
        cmd = cmds[role]
        assert "--audit-reads" in cmd and cmd[cmd.index("--max-waiting") + 1] == "64"
        assert "--clamp-context" in cmd and cmd[cmd.index("--scrub") + 1] == "poison"
        assert "True" not in cmd and "False" not in cmd
    plain = node_commands(_launch_args(), str(tmp_path / "s"))
    assert "--audit-reads" not in plain["prefill"] and "--clamp-context" not in plain["decode"]


def test_launch_pd_needs_at_least_one_node_of_each_role(capsys):
    import pytest

    from kvfence.cli import build_parser
    for argv in (["--prefill", "0"], ["--decode", "-1"]):
        with pytest.raises(SystemExit) as e:
            build_parser().parse_args(["launch-pd", *argv])
        assert e.value.code == 2 and "at least 1" in capsys.readouterr().err
    with pytest.raises(ValueError, match="at least one prefill"):
        node_commands(argparse.Namespace(**{**vars(_launch_args()), "prefill": 0}), "/s")


def test_every_engine_option_is_one_launch_pd_passes_on():
    # an engine option added later (--matmul was) must reach the nodes, not stop at launch-pd
    import argparse

    from kvfence.cli import _engine_args
    from kvfence.pd.launch import ENGINE_FLAGS

    p = argparse.ArgumentParser()
    _engine_args(p)
    assert {a.dest for a in p._actions if a.dest != "help"} - {"threads"} == set(ENGINE_FLAGS)


def test_every_launched_process_reads_every_option_it_is_given(tmp_path):
    """serve --role refuses an option its role would ignore: launch-pd (and the PD bench, which
    uses node_commands) must give each process only its own, with every option set."""
    from kvfence.cli import build_parser, ignored_flags

    a = _launch_args(argv=["--prefill", "2", "--kv-cache-memory", "64MiB", "--dtype", "float32", "--threads", "2",
                           "--lease", "9", "--transfer-buffer-pages", "40", "--max-model-len", "1024",
                           "--clamp-context", "--served-model-name", "m", "--prefill-routing", "round-robin",
                           "--max-body-bytes", "1000", "--audit-reads", "--no-prefix-cache"])
    for name, cmd in node_commands(a, str(tmp_path / "s")).items():
        parsed = build_parser().parse_args(cmd[cmd.index("serve"):])
        assert ignored_flags(parsed) == [], name


def test_every_engine_option_is_in_launch_pds_list():
    """launch.ENGINE_FLAGS is what launch-pd passes to the nodes and what a router refuses as
    not its own (cli.ignored_by_role): an engine option missing from it would again be dropped
    by launch-pd and silently ignored by the router (review)."""
    from kvfence import cli
    from kvfence.pd.launch import ENGINE_FLAGS

    p = argparse.ArgumentParser()
    cli._engine_args(p)
    assert {a.dest for a in p._actions if a.dest != "help"} == set(ENGINE_FLAGS) | {"threads"}


def test_only_nodes_take_an_accepted_secret():
    """The router only sends the credential and a single node holds no cluster secret: each
    would ignore --accept-cluster-secret-file, so each refuses it; a node reads it."""
    from kvfence.cli import build_parser, ignored_flags

    for role, ignored in (("router", ["--accept-cluster-secret-file"]), ("single", ["--accept-cluster-secret-file"]),
                          ("prefill", []), ("decode", [])):
        a = build_parser().parse_args(["serve", "--role", role, "--accept-cluster-secret-file", "/s"])
        assert ignored_flags(a) == ignored, role


def test_a_router_given_an_accepted_secret_is_told_what_a_router_takes(capsys):
    from kvfence.cli import main

    assert main(["serve", "--role", "router", "--accept-cluster-secret-file", "/s"]) == 2
    err = capsys.readouterr().err
    assert "a router only sends the credential" in err and "engine options" not in err


def test_launch_pd_passes_accepted_secret_files_to_the_nodes_only(tmp_path):
    """With --cluster-secret-file and --accept-cluster-secret-file, a launch-pd cluster rotates
    by editing the two files and a SIGHUP to launch-pd (docs/pd.md); a router accepts nothing
    (it would refuse the flag)."""
    from kvfence.cli import build_parser

    a = _launch_args(argv=["--prefill", "2", "--accept-cluster-secret-file", "/acc"])
    cmds = node_commands(a, str(tmp_path / "s"))
    for name, cmd in cmds.items():
        if name == "router":
            assert "--accept-cluster-secret-file" not in cmd
        else:
            assert cmd[cmd.index("--accept-cluster-secret-file") + 1] == "/acc"
            assert build_parser().parse_args(cmd[3:]).accept_cluster_secret_file == ["/acc"]
