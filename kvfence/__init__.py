"""kvfence: an LLM inference server in which no request can read KV-cache memory it does not own."""
import os as _os

# Spinning OpenMP workers starve other processes on small machines (measured: ~40x slower
# batched matmuls); this must be set before torch is first imported.
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from kvfence.engine.admission import CapacityError, ContextLengthExceeded  # noqa: E402
from kvfence.engine.llm import LLM, RequestOutput  # noqa: E402
from kvfence.engine.params import SamplingParams  # noqa: E402

__all__ = ["LLM", "SamplingParams", "RequestOutput", "ContextLengthExceeded", "CapacityError"]
__version__ = "0.1.0"
