"""The scheduler's rule before 9e2e0cc, for tests that show it is caught (a unit walk and the
PD simulation): while requests waited, running prefills kept a quarter of the prefill cap for
them even when the step budget was smaller, which left them no room at all."""
from __future__ import annotations

from kvfence.engine.scheduler import QUEUE_SHARE


def quarter_of_the_cap(self, budget: int, capped_so_far: int, capped: bool, for_queue: bool = False) -> int:
    """Scheduler._prefill_room as it was."""
    cap = self.prefill_budget_while_decoding
    room, whole = ((min(budget, cap - capped_so_far), cap) if capped and cap is not None
                   else (budget, self.token_budget))
    return room - whole // QUEUE_SHARE if for_queue else room
