"""Move KV pages between processes with the Mooncake Transfer Engine (TCP, P2P handshake).

One `PageTransport` wraps one Mooncake engine. Each side registers its transfer buffer
(pd/staging.py: sealed rows, never the KV pool) once, as one region (registering thousands
of per-row regions is slow), and hands its `session_id` and the buffer's base address to the
peer; the reader then pulls rows by offset.

Mooncake is imported lazily, so `import kvfence` never needs it.

Mooncake's ports (RPC/handshake and TCP data) listen on all interfaces whatever hostname
is given here, and a peer that can reach the machine can read and write registered
memory: so only sealed rows are ever registered (kvfence/pd/seal.py, docs/pd.md).

Known limit: the first transfer to a peer does the P2P handshake; if the peer accepts the
connection but never answers (hung, SIGSTOPped), that first call blocks about 60 s, and no
MC_* setting we found lowers it. Once connected, a hung peer fails within the timeouts below.
"""
from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

# Mooncake reads these once, when the first engine in a process is created; operator
# settings in the environment win. Defaults are 30 s or more, so a hung peer would stall a
# request (and every request behind it) that long; we want a bounded, clear failure.
_TIMEOUT_ENV = (
    "MC_TRANSFER_TIMEOUT",           # whole-transfer deadline (s)
    "MC_TCP_PROGRESS_TIMEOUT_SEC",   # no bytes moving on an open connection (s)
    "MC_TCP_STATUS_TIMEOUT_SEC",     # peer never sends the completion status frame (s)
    "MC_HANDSHAKE_CONNECT_TIMEOUT",  # connect() to the peer's handshake port (s)
)

# Mooncake rejects batches over 1,024 entries unless MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER
# is raised; chunking keeps us under it without touching a per-peer global.
MAX_BATCH = 1000


class TransferError(RuntimeError):
    """A transfer failed; the destination pages hold unknown data and must not be used."""


class PageTransport:
    def __init__(self, hostname: str = "127.0.0.1", timeout_s: int = 5):
        # timeout_s only sets the MC_* timeouts not already in the environment, and only
        # takes effect if this is the first Mooncake engine in the process.
        for name in _TIMEOUT_ENV:
            os.environ.setdefault(name, str(int(timeout_s)))
        try:
            from mooncake.engine import TransferEngine
        except ImportError as e:  # libibverbs1 missing is the usual cause
            raise ImportError(
                "kvfence PD transfer needs mooncake-transfer-engine-non-cuda and the Debian "
                f"package libibverbs1 (scripts/setup.sh installs both): {e}") from e
        self._engine = TransferEngine()
        rc = self._engine.initialize(hostname, "P2PHANDSHAKE", "tcp", "")
        if rc != 0:
            raise TransferError(f"Mooncake initialize({hostname!r}, tcp) failed: rc={rc}")
        self.hostname = hostname
        # what a peer passes as target_hostname to reach this engine
        self.session_id = f"{hostname}:{self._engine.get_rpc_port()}"
        self._regions: dict[int, tuple[int, object]] = {}  # base -> (nbytes, tensor kept alive)

    def register(self, tensor) -> int:
        """Register a whole contiguous CPU pool tensor once; return its base address."""
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError("register() needs a contiguous CPU tensor")
        base, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        if base in self._regions:
            return base
        rc = self._engine.register_memory(base, nbytes)
        if rc != 0:
            raise TransferError(f"Mooncake register_memory({nbytes} bytes) failed: rc={rc}")
        self._regions[base] = (nbytes, tensor)
        return base

    def unregister(self, base: int) -> None:
        if self._regions.pop(base, None) is not None:
            self._engine.unregister_memory(base)

    def close(self) -> None:
        for base in list(self._regions):
            self.unregister(base)

    def _check_local(self, addr: int, length: int) -> None:
        # Mooncake writes wherever we point it; refuse anything outside our own pools.
        for base, (nbytes, _) in self._regions.items():
            if base <= addr and addr + length <= base + nbytes:
                return
        raise ValueError(f"local range {addr:#x}+{length} is outside every registered pool")

    def read(self, peer_session: str, local_addrs: Sequence[int],
             remote_addrs: Sequence[int], lengths: Sequence[int]) -> int:
        """Pull arbitrary (local, remote, length) ranges from the peer; return bytes moved."""
        if not (len(local_addrs) == len(remote_addrs) == len(lengths)):
            raise ValueError("local_addrs, remote_addrs and lengths differ in length")
        for a, n in zip(local_addrs, lengths):
            if n <= 0:
                raise ValueError(f"bad length {n}")
            self._check_local(a, n)
        local_addrs, remote_addrs, lengths = list(local_addrs), list(remote_addrs), list(lengths)
        for i in range(0, len(lengths), MAX_BATCH):
            j = i + MAX_BATCH
            rc = self._engine.batch_transfer_sync_read(
                peer_session, local_addrs[i:j], remote_addrs[i:j], lengths[i:j])
            if rc != 0:
                raise TransferError(
                    f"Mooncake read from {peer_session} failed (rc={rc}) on entries "
                    f"{i}..{min(j, len(lengths)) - 1} of {len(lengths)}")
        return sum(lengths)

    def read_pages(self, peer_session: str, peer_base: int, local_base: int,
                   page_bytes: int, pairs: Iterable[tuple[int, int]]) -> int:
        """Pull whole pages: each (remote_page, local_page) copies page_bytes from
        peer_base + remote_page*page_bytes to local_base + local_page*page_bytes."""
        pairs = list(pairs)
        for r, l in pairs:
            if r < 0 or l < 0:
                raise ValueError(f"negative page index in {(r, l)}")
        return self.read(peer_session,
                         [local_base + l * page_bytes for _, l in pairs],
                         [peer_base + r * page_bytes for r, _ in pairs],
                         [page_bytes] * len(pairs))


class InProcessTransport:
    """The same interface as PageTransport, within one process (memmove between registered
    tensors). For unit tests and the deterministic simulation only: real PD nodes always
    use PageTransport."""

    _sessions: dict[str, InProcessTransport] = {}
    _count = 0

    def __init__(self, name: str | None = None):
        InProcessTransport._count += 1
        self.session_id = name or f"inproc:{InProcessTransport._count}"
        self._regions: dict[int, tuple[int, object]] = {}
        InProcessTransport._sessions[self.session_id] = self

    def register(self, tensor) -> int:
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError("register() needs a contiguous CPU tensor")
        base = tensor.data_ptr()
        self._regions[base] = (tensor.numel() * tensor.element_size(), tensor)
        return base

    def close(self) -> None:
        self._regions.clear()
        InProcessTransport._sessions.pop(self.session_id, None)

    def _inside(self, addr: int, length: int) -> bool:
        return any(b <= addr and addr + length <= b + n for b, (n, _) in self._regions.items())

    def read(self, peer_session: str, local_addrs, remote_addrs, lengths) -> int:
        import ctypes

        peer = InProcessTransport._sessions.get(peer_session)
        if peer is None:
            raise TransferError(f"no peer session {peer_session!r}")
        for a, r, n in zip(local_addrs, remote_addrs, lengths):
            if not self._inside(a, n):
                raise ValueError(f"local range {a:#x}+{n} is outside every registered region")
            if not peer._inside(r, n):
                raise TransferError(f"remote range {r:#x}+{n} is outside the peer's registered memory")
        for a, r, n in zip(local_addrs, remote_addrs, lengths):
            ctypes.memmove(a, r, n)
        return sum(lengths)
