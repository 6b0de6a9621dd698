"""A KV-pool owner in its own process: fills a pool with a known pattern, registers it,
prints {"session", "base"} as one JSON line, and serves until its stdin closes."""
import json
import sys

import torch

from kvfence.pd.transfer import PageTransport


def pattern(pages: int, page_bytes: int) -> torch.Tensor:
    # distinct per page and per byte, never zero (zero is what the reader starts with)
    idx = torch.arange(pages * page_bytes, dtype=torch.int64).view(pages, page_bytes)
    return ((idx * 7 + idx // page_bytes * 13) % 251 + 1).to(torch.uint8)


if __name__ == "__main__":
    pages, page_bytes = int(sys.argv[1]), int(sys.argv[2])
    pool = pattern(pages, page_bytes)
    t = PageTransport(timeout_s=2)
    base = t.register(pool)
    print(json.dumps({"session": t.session_id, "base": base}), flush=True)
    sys.stdin.read()  # serve until the test closes our stdin
