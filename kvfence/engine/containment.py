"""The containment rule, in one place: an exception raised while working on one request
ends that request (500 engine_error) and nothing else; the engine goes on.

Never contained: the ledger catching a page touched by a request that does not own it, or a
transition the state table forbids, means the engine's own bookkeeping is wrong; it stops
(fail closed), the process exits and a supervisor restarts it.
"""
from __future__ import annotations

from kvfence.engine.request_states import IllegalTransition
from kvfence.kv.ledger import LedgerError

FAIL_CLOSED = (LedgerError, IllegalTransition)

# consecutive steps in which every request failed, even alone, before the engine counts as broken
MAX_FAILED_STEPS = 3
