"""kvfence: an LLM inference server in which no request can read KV-cache memory it does not own."""
import os as _os
from typing import TYPE_CHECKING

# OpenMP workers that sleep between parallel regions (OMP_WAIT_POLICY=PASSIVE) pay a wake-up
# on each of the ~150 regions of a decode step: 13.4 s against 11.9 s for the bench workload
# when they spin a little first. Spinning long starves other processes on the same cores
# (two engines on 2 cores: 23 s each passive, 28 s at this spin count, 61 s at 30000), so
# the default is a short spin; co-located processes (launch-pd, the tests) set PASSIVE.
# Must be set before torch is first imported; an operator's own setting wins.
if "OMP_WAIT_POLICY" not in _os.environ:
    _os.environ.setdefault("GOMP_SPINCOUNT", "3000")

__all__ = ["LLM", "SamplingParams", "RequestOutput", "ContextLengthExceeded", "CapacityError"]
__version__ = "0.1.0"

# The Python API is imported on first use, not with the package: it brings torch (~1 s), and
# the CLI's commands that load no model (--help, secret, drain, a refused start) need none.
_API = {"LLM": "kvfence.engine.llm", "RequestOutput": "kvfence.engine.llm",
        "SamplingParams": "kvfence.engine.params", "ContextLengthExceeded": "kvfence.engine.admission",
        "CapacityError": "kvfence.engine.admission"}


if TYPE_CHECKING:   # what type checkers and editors read; at run time __getattr__ imports them
    from kvfence.engine.admission import CapacityError, ContextLengthExceeded
    from kvfence.engine.llm import LLM, RequestOutput
    from kvfence.engine.params import SamplingParams


def __getattr__(name: str) -> object:
    if name in _API:
        import importlib

        return getattr(importlib.import_module(_API[name]), name)
    raise AttributeError(f"module 'kvfence' has no attribute {name!r}")


def __dir__() -> list[str]:
    # What the module offers: the dunders, the lazy API; not its own helpers (_os, _API, ...).
    own = {n for n in globals() if n.startswith("__") or not n.startswith("_")} - {"TYPE_CHECKING"}
    return sorted(own | set(_API))
