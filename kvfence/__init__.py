"""kvfence: an LLM inference server in which no request can read KV-cache memory it does not own."""
import os as _os

# OpenMP workers that sleep between parallel regions (OMP_WAIT_POLICY=PASSIVE) pay a wake-up
# on each of the ~150 regions of a decode step: 13.4 s against 11.9 s for the bench workload
# when they spin a little first. Spinning long starves other processes on the same cores
# (two engines on 2 cores: 23 s each passive, 28 s at this spin count, 61 s at 30000), so
# the default is a short spin; co-located processes (launch-pd, the tests) set PASSIVE.
# Must be set before torch is first imported; an operator's own setting wins.
if "OMP_WAIT_POLICY" not in _os.environ:
    _os.environ.setdefault("GOMP_SPINCOUNT", "3000")

from kvfence.engine.admission import CapacityError, ContextLengthExceeded  # noqa: E402
from kvfence.engine.llm import LLM, RequestOutput  # noqa: E402
from kvfence.engine.params import SamplingParams  # noqa: E402

__all__ = ["LLM", "SamplingParams", "RequestOutput", "ContextLengthExceeded", "CapacityError"]
__version__ = "0.1.0"
