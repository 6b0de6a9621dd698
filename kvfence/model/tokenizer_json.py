"""Reading a tokenizer.json's parsed tree (its pre-tokenizer nests Sequences of steps)."""
from __future__ import annotations

from collections.abc import Iterator


def objects(node) -> Iterator[dict]:
    """Every JSON object in `node`, itself included, outermost first."""
    if isinstance(node, dict):
        yield node
        for v in node.values():
            yield from objects(v)
    elif isinstance(node, list):
        for v in node:
            yield from objects(v)
