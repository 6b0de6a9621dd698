"""Named fault points, for tests that show each isolation defense stopping the bug class.

A fault point is a named place in the code that, when the fault is enabled, takes the
broken path on purpose (skips a check, hands off a placeholder, loses a message, ...).
Faults are off unless a test turns them on explicitly, in one of two ways:

  KVFENCE_TEST_FAULTS=skip_ledger_check,delay_transfer_completion:2.5   (environment, read at import)
  with faults.injected("skip_ledger_check"): ...                          (in-process, for tests)

No configuration file, command-line flag or request field can enable one. An unknown
name is an error (a typo must not silently test nothing). A server that starts with any
fault enabled says so loudly: an ERROR-level banner, a failed start-up check in the
isolation statement, and the gauge `kvfence_fault_injection_active`.

`active(name)` is a single truth test of a module global when nothing is enabled, so the
points cost nothing in production.
"""
from __future__ import annotations

import logging
import os
import threading
from collections import Counter
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

ENV_VAR = "KVFENCE_TEST_FAULTS"

# name -> what enabling it does. The single-node ones are wired in kvfence/kv/ledger.py and
# kvfence/engine/admission.py; the PD ones in kvfence/pd/*.
FAULTS: dict[str, str] = {
    "skip_router_admission": "the PD router forwards a request without checking it fits the cluster's context (I4)",
    "skip_node_admission": "a node admits a request without checking prompt + max_tokens against its usable "
                           "context (I4)",
    "handoff_placeholder": "the incident: prefill rejects an over-length prompt, replaces it with a one-token "
                           "placeholder, and still hands it off to decode",
    "skip_ledger_check": "the per-pass ownership check (I2, I3) passes every sequence without looking",
    "skip_watermark": "the per-pass check skips only the written-watermark part (I3)",
    "write_shared_page": "the per-pass check lets a sequence write into a read-only SHARED prefix page of its own "
                         "cache scope (I9: one choice of an n > 1 request overwrites the prompt pages the others read)",
    "skip_row_auth": "decode decrypts transferred rows without checking their AEAD tags (I5, I10)",
    "skip_row_seal": "prefill stages rows in the clear, as a network peer could read them without I10 (decode's "
                     "authentication then fails)",
    "free_on_abort_during_transfer": "an aborted request's pages are freed at once although a transfer may still "
                                     "write into them (I6)",
    "fence_pull_from_submit": "decode fences a given-up pull's rows from when the pull was queued, not from when "
                              "its read began, and lets a queued read begin after its request gave up (I6)",
    "drop_transfer_completion": "a transfer's completion notice is lost",
    "delay_transfer_completion": "a transfer's completion notice is delayed by ARG seconds (default 1)",
    "duplicate_transfer_completion": "a transfer's completion notice is delivered twice",
    "kill_node_at": "the node process exits at the point named by ARG",
    "corrupt_staged_page": "prefill flips one byte of a staged row after sealing it (a corrupted transfer, I5)",
    "lose_forget_tenants": "the PD router's forget_tenants messages after a tenants-file reload reach no node (as "
                           "if every node were unreachable at that moment)",
    "delay_handoff": "the PD router waits ARG seconds (default 1) between prefill and decode",
    "slow_steps": "each engine step with work waits ARG seconds (default 0.05) first, so a running request holds "
                  "its pages long enough for a test to act on a fast machine",
    "poison_request": "processing the sampled token of a request whose prompt contains token id ARG raises "
                      "(containment: only that request fails)",
    "poison_forward": "a forward pass that includes a request whose prompt contains token id ARG raises; ARG 'all': "
                      "every forward pass raises (the engine is broken and the process exits)",
    "poison_link": "the KV link's work on a request whose prompt contains token id ARG raises (prefill: while "
                   "staging its rows; decode: while opening its pulled rows); containment: only that request fails",
    "skip_boot_check": "a PD node serves a request the router addressed to an earlier boot of it, before the router "
                       "checked the restarted process (I8)",
    "skip_manifest_check": "decode takes a handoff without checking it is for this request, tenant, token count "
                           "and model (I4, I5)",
    "attend_reserved_length": "the incident's decode: after a transfer it treats the whole prompt as computed, "
                              "whatever the manifest verified (I3)",
}


class FaultConfigError(ValueError):
    """An unknown fault name, or a malformed KVFENCE_TEST_FAULTS value."""


_lock = threading.Lock()
_env: dict[str, str | None] = {}
_stack: list[dict[str, str | None]] = []
_active: dict[str, str | None] = {}   # what active() reads; replaced whole, never mutated in place
fired: Counter[str] = Counter()       # how often each enabled point took its broken path


def parse(spec: str) -> dict[str, str | None]:
    """'a,b:2.5' -> {'a': None, 'b': '2.5'}; unknown names raise FaultConfigError."""
    out: dict[str, str | None] = {}
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        name, sep, arg = part.partition(":")
        name = name.strip()
        if name not in FAULTS:
            raise FaultConfigError(f"unknown fault {name!r} in {ENV_VAR}; known: {', '.join(sorted(FAULTS))}")
        out[name] = arg.strip() if sep else None
    return out


def _recompute() -> None:
    global _active
    merged = dict(_env)
    for layer in _stack:
        merged.update(layer)
    _active = merged


def load_env(environ: Mapping[str, str] | None = None) -> dict[str, str | None]:
    """(Re)read KVFENCE_TEST_FAULTS. Called at import; tests call it after changing the variable."""
    global _env
    spec = (os.environ if environ is None else environ).get(ENV_VAR, "")
    parsed = parse(spec)
    with _lock:
        _env = parsed
        _recompute()
    return dict(parsed)


@contextmanager
def injected(*specs: str, **with_args: object) -> Iterator[None]:
    """Enable faults for the duration of a with-block: injected("skip_watermark"),
    injected("delay_transfer_completion:2.5") or injected(delay_transfer_completion=2.5)."""
    layer = parse(",".join(specs))
    for name, arg in with_args.items():
        layer.update(parse(name))
        layer[name] = None if arg is None or arg is True else str(arg)
    with _lock:
        _stack.append(layer)
        _recompute()
    try:
        yield
    finally:
        with _lock:
            _stack.remove(layer)
            _recompute()


def active(name: str) -> bool:
    """Is fault `name` enabled? Counts a hit in `fired` when it is."""
    if not _active:
        return False
    if name not in FAULTS:
        raise FaultConfigError(f"fault point names an unknown fault {name!r}")
    if name in _active:
        fired[name] += 1
        return True
    return False


def arg(name: str, default: str | None = None) -> str | None:
    """The ARG given with an enabled fault ('name:ARG'), else default."""
    a = _active.get(name) if _active else None
    return default if a is None else a


def arg_float(name: str, default: float) -> float:
    a = arg(name)
    try:
        return default if a is None else float(a)
    except ValueError:
        raise FaultConfigError(f"fault {name} needs a number as its argument, got {a!r}") from None


def enabled() -> dict[str, str | None]:
    """The enabled faults and their arguments (a copy)."""
    return dict(_active)


def any_active() -> bool:
    return bool(_active)


# the faults that switch off or get past a defense: with one on, a cross-tenant read or
# transfer may happen without the refusal that would record it, so the incident log's silence
# proves nothing for that process (disclosure.py). The others (lost, late or doubled notices,
# kills, corruption that authentication catches, poisoned requests) leave every check running.
SKIPS_A_CHECK = frozenset({
    "skip_router_admission", "skip_node_admission", "handoff_placeholder", "skip_ledger_check", "skip_watermark",
    "write_shared_page", "skip_row_auth", "skip_row_seal", "free_on_abort_during_transfer",
    "fence_pull_from_submit", "lose_forget_tenants", "skip_boot_check", "skip_manifest_check",
    "attend_reserved_length"})
KEEPS_THE_CHECKS = frozenset({
    "drop_transfer_completion", "delay_transfer_completion", "duplicate_transfer_completion", "kill_node_at",
    "corrupt_staged_page", "delay_handoff", "slow_steps", "poison_request", "poison_forward", "poison_link"})


def describe() -> list[str]:
    return [n if a is None else f"{n}:{a}" for n, a in sorted(_active.items())]


def record_active(how: str = "on") -> None:
    """The incident log's faults_active record for the points on now: the one place its detail
    is written, since the disclosure report reads the fault names out of it."""
    from kvfence import incidents

    incidents.record("faults_active", detail=f"test fault points {how}: " + ", ".join(describe()))


def banner() -> str | None:
    """The start-up banner text when any fault is enabled, else None."""
    if not _active:
        return None
    lines = ["!" * 78,
             "!!! FAULT INJECTION ACTIVE - THIS SERVER IS DELIBERATELY BROKEN. NEVER SERVE REAL TRAFFIC !!!",
             f"!!! {ENV_VAR}={','.join(describe())}"]
    lines += [f"!!!   {n}: {FAULTS[n]}" for n in sorted(_active)]
    lines.append("!" * 78)
    return "\n".join(lines)


def announce(logger: logging.Logger | None = None) -> bool:
    """Log the banner at ERROR level if any fault is enabled; True if it did."""
    text = banner()
    if text is None:
        return False
    (logger or logging.getLogger("kvfence.faults")).error("\n%s", text)
    return True


load_env()
