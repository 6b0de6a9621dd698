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
