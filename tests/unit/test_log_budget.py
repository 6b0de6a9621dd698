"""LogBudget (server/log_budget.py): a tenant looping on a refused request adds a bounded
number of log lines, and the next line written says how many were left out."""
from kvfence.server.log_budget import LogBudget


def test_lines_past_the_budget_are_counted_and_said_by_the_next_written_one():
    now = [0.0]
    b = LogBudget(per_window=3, window_s=10, clock=lambda: now[0])
    assert [b.take("bob") for _ in range(3)] == [0, 0, 0]
    assert [b.take("bob") for _ in range(50)] == [None] * 50
    assert b.take("alice") == 0                   # another tenant has its own budget
    now[0] = 10.0
    assert b.take("bob") == 50                    # a new window: the first line says what was left out
    assert b.take("bob") == 0


def test_the_table_is_bounded():
    b = LogBudget(per_window=1, max_keys=8, clock=lambda: 0.0)
    for i in range(100):
        assert b.take(f"t{i}") == 0
    assert len(b._windows) == 8
