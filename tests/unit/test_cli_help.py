"""`kvfence serve --help` names the defaults an operator tunes (found by an operator
walkthrough: --max-waiting, --max-connections and the timeouts showed none)."""
from __future__ import annotations

import re

from kvfence.cli import build_parser


def _help(command: str) -> str:
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return re.sub(r"\s+", " ", sub.choices[command].format_help())


def test_serve_help_names_each_default():
    text = _help("serve")
    for option, default in (("--port PORT", "8000"), ("--max-waiting MAX_WAITING", "1024"),
                            ("--max-connections MAX_CONNECTIONS", "2048"), ("--header-timeout HEADER_TIMEOUT", "10.0"),
                            ("--body-timeout BODY_TIMEOUT", "60.0"), ("--max-num-seqs MAX_NUM_SEQS", "256"),
                            ("--kv-memory-fraction KV_MEMORY_FRACTION", "0.1"), ("--max-body-bytes MAX_BODY_BYTES",
                                                                                  "8388608")):
        after = text.split(f" {option} ", 1)[1]
        shown = after.split(" --", 1)[0]
        assert f"(default: {default})" in shown, (option, shown)
    # options whose text already speaks of their default, and flags, are left alone
    assert "(default: None)" not in text and "(default: False)" not in text

