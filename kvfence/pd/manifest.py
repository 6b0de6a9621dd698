"""What decode checks of a handoff (I5), and the header each transferred page is bound to.

A handoff is a manifest (kvfence/pd/messages.py: request id, tenant, token and page counts,
per-page row epoch, model and KV-layout fingerprint, the prefill boot id, the seal salt and
lease deadline), the transfer source the router read from the prefill node, and the sealed
rows themselves. Each row is bound by AEAD to its page header (request, tenant, prefill
process, epoch, page index, page count, tokens in the page), which decode builds from the
manifest: a row that opens under that header is the page the manifest promised, and
nothing else opens (kvfence/pd/seal.py). Decode runs nothing until every page opened, and
then attends exactly `token_count` tokens (I3).
"""
from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

from kvfence.pd.messages import Handoff, Manifest

MAGIC = b"KVF2"
# magic, request digest, tenant digest, boot digest, epoch, page index, page count, tokens in page
_HEADER = struct.Struct("<4s32s32s32sQIII")


class ManifestError(ValueError):
    """A handoff that must not be used; the message says which check failed."""


def digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode(), digest_size=32).digest()


@dataclass(frozen=True)
class PageHeader:
    """A page's identity: the associated data its row is sealed with (never stored)."""
    request_id: str
    tenant: str
    boot_id: str
    epoch: int
    index: int
    count: int
    tokens: int

    def pack(self) -> bytes:
        return _HEADER.pack(MAGIC, digest(self.request_id), digest(self.tenant), digest(self.boot_id),
                            self.epoch, self.index, self.count, self.tokens)


def page_header(m: Manifest, i: int) -> PageHeader:
    """The header page i of the manifest's handoff is sealed under."""
    tokens = min(m.page_size, m.token_count - i * m.page_size)
    return PageHeader(m.request_id, m.tenant, m.boot_id, m.epochs[i], i, m.page_count, tokens)


def parse_handoff(data: object) -> Handoff:
    """The handoff decode was given, checked field by field (ManifestError if malformed)."""
    if isinstance(data, Handoff):
        return data
    try:
        return Handoff.from_json(data)
    except ValueError as e:
        raise ManifestError(str(e)) from None


def check_manifest(h: Handoff, *, request_id: str, tenant: str, token_count: int, page_size: int,
                   fingerprint: str, layout: str, slot_bytes: int) -> None:
    """Decode's checks before it reserves anything: the manifest is for this request and
    this model, comes from the prefill process the source names, and its counts are the
    ones the router asked for (never trust its own)."""
    m = h.manifest
    problems = []
    if m.request_id != request_id:
        problems.append(f"manifest is for request {m.request_id!r}, not {request_id!r}")
    if m.tenant != tenant:
        problems.append("manifest names another tenant")
    if m.boot_id != h.source.boot_id:
        problems.append("manifest is from another prefill process than the transfer source")
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
