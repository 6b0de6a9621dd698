"""`kvfence secret new|id`: make a cluster secret file, and name files by key id without
printing a secret (each step of a rotation is checked by key ids, docs/pd.md)."""
from __future__ import annotations

import os
import stat

from kvfence.cli import main
from kvfence.pd.seal import key_id, load_secret


def test_new_makes_a_private_file_and_never_writes_over_one(tmp_path, capsys):
    path = str(tmp_path / "next.secret")
    assert main(["secret", "new", path]) == 0
    secret = load_secret(path, env={})
    out = capsys.readouterr().out
    assert out.split() == [key_id(secret), path] and secret.decode() not in out
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert main(["secret", "new", path]) == 1
    assert "mv" in capsys.readouterr().err and load_secret(path, env={}) == secret   # untouched


def test_id_names_each_file_by_key_id_and_holds_it_to_the_file_checks(tmp_path, capsys):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    for p in (a, b):
        assert main(["secret", "new", p]) == 0
    capsys.readouterr()
    assert main(["secret", "id", a, b]) == 0
    out = capsys.readouterr().out
    assert out.splitlines() == [f"{key_id(load_secret(p, env={}))}  {p}" for p in (a, b)]
    os.chmod(b, 0o644)
    assert main(["secret", "id", a, b]) == 1
    got = capsys.readouterr()
    assert got.out.split() == [key_id(load_secret(a, env={})), a] and "chmod 600" in got.err
    assert load_secret(a, env={}).decode() not in got.out + got.err
