"""The declared boundary between the engine and a KV link (PD prefill or decode).

The engine asks a link side-effect-free questions (`busy`, `holds_pool_pages`,
`next_timer`, `stats`, `facts`) and tells it facts (`on_end`: a request ended). At two
points of every step (`before_step`, `after_step`), on admission (`check`, `enqueue`) and
on control messages (`release`, `abort`) the link answers with *decisions*; the engine
applies every state change they imply (ends, reservations, the written watermark,
scheduling). The hooks are generators: the engine applies each decision before it asks
for the next, so a link that decides in a loop sees the effect of its earlier decisions
(decode's next reservation sees the pages the last one took). A link changes only what it
owns: its transfer buffer, its rows' ledger, its pulls and leases. A single-node engine
has `NoKvLink`, so the engine never checks for None.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from kvfence.engine.containment import FAIL_CLOSED
from kvfence.engine.request_states import Event
from kvfence.engine.sequence import Sequence

if TYPE_CHECKING:
    from kvfence.kv.ledger import Violation
    from kvfence.pd.messages import Handoff


@dataclass(frozen=True)
class EndRequest:
    """End the request with ABORT. `notify`: also tell its client (decode's kv_failed event;
    a request prefill holds has already been answered with its manifest)."""
    seq: Sequence
    code: str
    message: str
    reader_stopped: bool
    notify: bool = False


@dataclass(frozen=True)
class ReleaseRequest:
    """Decode verified the transfer: end the held request with RELEASE (rows free at once)."""
    seq: Sequence


@dataclass(frozen=True)
class Reserve:
    """Decode: grant the request every pool page it will need (AWAITING_KV)."""
    seq: Sequence
    pages: int


@dataclass(frozen=True)
class Hold:
    """Prefill: the request's KV is staged in rows; its pool pages may go (KV_HELD).
    `manifest` is the handoff document for the router (a JSON object)."""
    seq: Sequence
    manifest: dict[str, Any]


@dataclass(frozen=True)
class ReadRefused:
    """A read the link was about to make failed the ledger's check (I2/I3)."""
    seq: Sequence
    violation: Violation


@dataclass(frozen=True)
class KvArrived:
    """Decode: `tokens` tokens of verified KV are in the request's pool pages; it may run."""
    seq: Sequence
    tokens: int


@dataclass(frozen=True)
class Failed:
    """The link's work on this request raised: the engine ends it alone, as it ends a request
    whose forward pass raised (500 engine_error). The link has put back what that work took."""
    seq: Sequence
    error: Exception


Decision = EndRequest | ReleaseRequest | Reserve | Hold | ReadRefused | KvArrived | Failed


def contained(seq: Sequence, work: Iterable[Decision], undo: Callable[[], None] = lambda: None) -> Iterator[Decision]:
    """The decisions of a link's work on one request; if the work raises (but for a fail-closed
    error), `undo()` puts back what it took in the link and the request ends as Failed, so a
    link bug or a bad input ends one request, not the node."""
    try:
        yield from work
    except FAIL_CLOSED:
        raise
    except Exception as e:  # noqa: BLE001 - only this request fails
        undo()
        yield Failed(seq, e)


class KvLink(Protocol):
    """What LLMEngine calls on its link. Decisions are applied in order."""

    role: str

    # questions (no side effects)
    def busy(self) -> bool: ...
    def holds_pool_pages(self) -> bool: ...
    def next_timer(self) -> float | None: ...
    def queued(self) -> list[Sequence]: ...   # admitted requests waiting inside the link
    def reader_stopped(self, request_id: str) -> bool: ...   # no transfer read of it can be running
    def stats(self) -> dict[str, Any]: ...
    def facts(self) -> dict[str, Any] | None: ...

    # admission (decode): check raises ManifestError (a ValueError) for a handoff this node
    # must not take, else returns the parsed manifest; enqueue queues the admitted request
    def check(self, seq: Sequence, handoff: object) -> Handoff: ...
    def enqueue(self, seq: Sequence, now: float) -> Iterable[Decision]: ...

    # the two points of a step
    def before_step(self, now: float) -> Iterable[Decision]: ...
    def after_step(self, prefilled: list[Sequence], now: float) -> Iterable[Decision]: ...

    # control messages (prefill): no decision means the request is not (or no longer) held
    def release(self, request_id: str) -> Iterable[Decision]: ...
    def abort(self, request_id: str, reader_stopped: bool, reason: str) -> Iterable[Decision]: ...

    # a fact: the request ended (the link frees or fences what it holds for it)
    def on_end(self, seq: Sequence, event: Event, reader_stopped: bool) -> None: ...

    def close(self) -> None: ...


class KvLinkBase:
    """The hooks' defaults: nothing held outside the scheduler, nothing arriving by
    transfer, nothing to decide. NoKvLink is exactly this; PD links override what they use."""

    role = "single"

    def busy(self) -> bool:
        return False

    def holds_pool_pages(self) -> bool:
        return False

    def next_timer(self) -> float | None:
        return None

    def queued(self) -> list[Sequence]:
        return []

    def reader_stopped(self, request_id: str) -> bool:
        return True

    def stats(self) -> dict[str, Any]:
        return {}

    def facts(self) -> dict[str, Any] | None:
        return None

    def check(self, seq: Sequence, handoff: object) -> Handoff:
        raise ValueError(f"a {self.role} node takes no KV handoff")

    def enqueue(self, seq: Sequence, now: float) -> Iterable[Decision]:
        raise ValueError(f"a {self.role} node takes no KV handoff")

    def before_step(self, now: float) -> Iterable[Decision]:
        return ()

    def after_step(self, prefilled: list[Sequence], now: float) -> Iterable[Decision]:
        return ()

    def release(self, request_id: str) -> Iterable[Decision]:
        return ()

    def abort(self, request_id: str, reader_stopped: bool, reason: str) -> Iterable[Decision]:
        return ()

    def on_end(self, seq: Sequence, event: Event, reader_stopped: bool) -> None:
        pass

    def close(self) -> None:
        pass


class NoKvLink(KvLinkBase):
    """A single node."""
