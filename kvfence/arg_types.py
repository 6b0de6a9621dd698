"""Command-line value types: a value that cannot work is refused by argparse, naming the
option, before anything starts (a negative request count hung the bench, a soak of 0 s
passed, a port past 65535 failed after the model had loaded)."""
from __future__ import annotations

import argparse
import math
import os
import ssl
from pathlib import Path


def at_least_one(text: str) -> int:
    n = _int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def port(text: str) -> int:
    n = _int(text)
    if not 1 <= n <= 65535:
        raise argparse.ArgumentTypeError(f"a TCP port is 1-65535, got {n}")
    return n


def listen_port(text: str) -> int:
    """A port to listen on: 0 lets the system choose one."""
    return 0 if _int(text) == 0 else port(text)


def seconds(text: str) -> float:
    """A finite number of seconds above 0."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not (math.isfinite(v) and v > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds above 0, got {text}")
    return v


def fraction(text: str) -> float:
    """A share in [0, 1]."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0.0 <= v <= 1.0:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {text}")
    return v


def output_file(text: str) -> str:
    """A file the command will write at its end: its folder must exist and take files now, not
    after a 30-minute soak."""
    p = Path(text)
    if p.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder; name a file")
    folder = p.parent if str(p.parent) else Path(".")
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"no folder {folder} to write {p.name} into")
    if not os.access(folder, os.W_OK):
        raise argparse.ArgumentTypeError(f"cannot write into {folder}")
    return text


def folder(text: str) -> str:
    """A folder the command writes into (made if missing)."""
    if Path(text).exists() and not Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text} exists and is not a folder")
    return text


def sha256_hex(text: str) -> str:
    """A SHA-256 as 64 hex digits (a typo read as a hash the chain never reaches: tampering)."""
    t = text.strip().lower()
    if len(t) != 64 or any(c not in "0123456789abcdef" for c in t):
        raise argparse.ArgumentTypeError(f"{text!r} is not a SHA-256 hash (64 hex digits)")
    return t


def ca_bundle(text: str) -> ssl.SSLContext:
    """--tls-ca of a command that reaches a server by --url: a PEM file of the CA(s) that signed the
    server's certificate, as a context that verifies the chain and the host name against it (a
    private CA otherwise fails mid-run with CERTIFICATE_VERIFY_FAILED)."""
    try:
        return ssl.create_default_context(cafile=text)
    except (OSError, ssl.SSLError) as e:
        raise argparse.ArgumentTypeError(f"cannot read CA certificates from {text}: {e}") from None


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
