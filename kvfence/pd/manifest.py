"""What travels with a KV handoff, and decode's check of it (I5).

A handoff is a manifest (kvfence/pd/messages.py: request id, tenant, token and page counts, per-page epoch and
checksum, model and KV-layout fingerprint, the prefill process's registration and lease
deadline) plus the staged pages themselves. Every staged page starts with a header that
names the request, tenant, prefill process and epoch it was staged for, so the bytes that
arrive say whose they are; the checksum covers header and data. Decode runs nothing until
every page passed `verify_pages` and then attends exactly `token_count` tokens (I3).
"""
from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

from kvfence.pd.messages import Manifest

MAGIC = b"KVF1"
HEADER_BYTES = 64
# magic, request digest, tenant digest, boot digest, epoch, page index, page count, tokens in page
_HEADER = struct.Struct("<4s16s8s8sqIII")


class ManifestError(ValueError):
    """A handoff that must not be used; the message says which check failed."""


def digest(text: str, size: int) -> bytes:
    return hashlib.blake2b(text.encode(), digest_size=size).digest()


def page_checksum(slot_bytes) -> str:
    return hashlib.blake2b(slot_bytes, digest_size=16).hexdigest()


@dataclass(frozen=True)
class PageHeader:
    request_id: str
    tenant: str
    boot_id: str
    epoch: int
    index: int
    count: int
    tokens: int

    def pack(self) -> bytes:
        raw = _HEADER.pack(MAGIC, digest(self.request_id, 16), digest(self.tenant, 8), digest(self.boot_id, 8),
                           self.epoch, self.index, self.count, self.tokens)
        return raw.ljust(HEADER_BYTES, b"\0")

    def matches(self, raw: bytes) -> str | None:
        """None if raw is this header, else what differs."""
        try:
            magic, req, ten, boot, epoch, index, count, tokens = _HEADER.unpack_from(raw)
        except struct.error:
            return "short header"
        if magic != MAGIC:
            return "no page header (bytes are not a staged kvfence page)"
        for name, got, want in (("request", req, digest(self.request_id, 16)),
                                ("tenant", ten, digest(self.tenant, 8)),
                                ("prefill process", boot, digest(self.boot_id, 8)),
                                ("epoch", epoch, self.epoch), ("page index", index, self.index),
                                ("page count", count, self.count), ("token count", tokens, self.tokens)):
            if got != want:
                return f"page header names another {name}"
        return None


def page_header(m: Manifest, i: int) -> PageHeader:
    """The header page i of the manifest's handoff must carry."""
    tokens = min(m.page_size, m.token_count - i * m.page_size)
    return PageHeader(m.request_id, m.tenant, m.boot_id, m.epochs[i], i, m.page_count, tokens)


def parse_manifest(data: object) -> Manifest:
    """The manifest decode was handed, checked field by field (ManifestError if malformed)."""
    if isinstance(data, Manifest):
        return data
    try:
        return Manifest.from_json(data)
    except ValueError as e:
        raise ManifestError(str(e)) from None


def check_manifest(m: Manifest, *, request_id: str, tenant: str, token_count: int, page_size: int,
                   fingerprint: str, layout: str, slot_bytes: int) -> None:
    """Decode's checks before it reserves anything: the manifest is for this request and
    this model, and its counts are the ones the router asked for (never trust its own)."""
    problems = []
    if m.request_id != request_id:
        problems.append(f"manifest is for request {m.request_id!r}, not {request_id!r}")
    if m.tenant != tenant:
        problems.append("manifest names another tenant")
    if m.token_count != token_count:
        problems.append(f"manifest holds {m.token_count} tokens, the request needs {token_count}")
    if m.page_size != page_size or m.page_count != -(-token_count // page_size):
        problems.append(f"manifest has {m.page_count} pages of {m.page_size} tokens for {token_count} tokens "
                        f"(decode pages hold {page_size})")
    if m.fingerprint != fingerprint:
        problems.append(f"model fingerprint {m.fingerprint} differs from decode's {fingerprint}")
    if m.layout != layout or m.slot_bytes != slot_bytes:
        problems.append(f"KV layout {m.layout}/{m.slot_bytes} differs from decode's {layout}/{slot_bytes}")
    if problems:
        raise ManifestError("; ".join(problems))


def verify_pages(m: Manifest, rows, skip_checksum: bool = False) -> str | None:
    """I5 on the bytes that arrived: rows[i] is page i's staged bytes (header + data).
    Returns None when every page is the one the manifest promised, else the first problem."""
    if len(rows) != m.page_count:
        return f"{len(rows)} pages arrived, the manifest lists {m.page_count}"
    for i, row in enumerate(rows):
        raw = bytes(row[:HEADER_BYTES])
        problem = page_header(m, i).matches(raw)
        if problem is not None:
            return f"page {i}: {problem}"
        if not skip_checksum and page_checksum(row) != m.checksums[i]:
            return f"page {i}: checksum mismatch"
    return None
