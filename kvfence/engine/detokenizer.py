"""Incremental detokenization with stop strings.

Each step decodes only a short window of recent tokens (prefix offset / read offset,
as in vLLM and HF TextStreamer): the text of window[prefix:read] was already emitted,
and what the new tokens add beyond it is emitted once it no longer ends in U+FFFD,
i.e. once no UTF-8 character is left half-decoded. Text that might be the start of a
stop string is held back until it is known either way, so a streamed delta never
contains text that a stop string later cuts.
"""
from __future__ import annotations

from typing import Any

from kvfence.engine.params import SamplingParams

REPLACEMENT_CHAR = "\ufffd"

# Prompt tokens decoded ahead of the output so the first output token renders as a
# continuation (e.g. keeps its leading space under Metaspace-style decoders).
PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._tokenizer = tokenizer
        self._skip_special = params.skip_special_tokens
        self._stops = list(params.stop)
        # per stop string: its prefix function, and how much of it the text so far ends with
        # (KMP). Trying every length per token instead cost O(len(stop)^2) a token: 10 ms with
        # 16 stops of 4,096 characters that the output kept half-matching.
        self._borders = [_prefix_function(stop) for stop in self._stops]
        self._matched = [0] * len(self._stops)
        self._include_stop = params.include_stop_str_in_output

        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        context_text = self._decode(context) if context else ""
        if context_text.endswith(REPLACEMENT_CHAR):
            # The prompt ends inside a character: the output's first bytes would complete
            # it and shift the window's text, so decode the output on its own instead.
            context, context_text = [], ""
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._prefix_len = len(context_text)   # len(decode(ids[prefix_offset:read_offset]))

        self._pending = ""                      # decoded, held back as a possible stop-string start
        self._chunks: list[str] = []
        self._text_cache: str | None = ""
        self.stopped_by: str | None = None

    @property
    def text(self) -> str:
        """All output text emitted so far (held-back text excluded)."""
        if self._text_cache is None:
            self._text_cache = "".join(self._chunks)
        return self._text_cache

    def add(self, token_id: int, stops_active: bool = True) -> str:
        """Take one generated token; return the text it finalizes (possibly ""). With
        `stops_active` False (before min_tokens) no stop string ends the output: one wholly
        in that text is emitted; one that ends once stops are active is found (its start is
        still held back)."""
        if self.stopped_by is not None:
            return ""
        self._ids.append(token_id)
        new_text = self._decode(self._ids[self._prefix_offset:])
        if len(new_text) <= self._prefix_len or new_text.endswith(REPLACEMENT_CHAR):
            return ""  # nothing new yet (special token skipped) or a character still incomplete
        piece = new_text[self._prefix_len:]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._prefix_len = len(self._decode(self._ids[self._prefix_offset:self._read_offset]))
        return self._emit(piece, final=False, stops_active=stops_active)

    def flush(self) -> str:
        """End of generation: return everything still held back (incomplete bytes as U+FFFD)."""
        if self.stopped_by is not None:
            return ""
        piece = ""
        if len(self._ids) > self._read_offset:
            new_text = self._decode(self._ids[self._prefix_offset:])
            piece = new_text[self._prefix_len:]
        # Start a fresh window: the flushed bytes must not be decoded again.
        self._prefix_offset = self._read_offset = len(self._ids)
        self._prefix_len = 0
        return self._emit(piece, final=True)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def _emit(self, piece: str, final: bool, stops_active: bool = True) -> str:
        if not self._stops:
            return self._append(piece)
        # Invariant: no stop string can start in already-emitted text (any partial match
        # is kept in _pending), so searching pending + piece finds every match.
        buf = self._pending + piece
        self._follow(piece)
        hit = self._find_stop(buf) if stops_active else None
        if hit is not None:
            pos, stop = hit
            self.stopped_by = stop
            self._pending = ""
            return self._append(buf[:pos] + (stop if self._include_stop else ""))
        hold = 0 if final else self._stop_prefix_len(buf)
        self._pending = buf[len(buf) - hold:]
        return self._append(buf[:len(buf) - hold])

    def _append(self, out: str) -> str:
        if out:
            self._chunks.append(out)
            self._text_cache = None
        return out

    def _find_stop(self, buf: str) -> tuple[int, str] | None:
        """Earliest stop string in buf (the longer one on a tie)."""
        best: tuple[int, str] | None = None
        for stop in self._stops:
            pos = buf.find(stop)
            if pos >= 0 and (best is None or pos < best[0] or (pos == best[0] and len(stop) > len(best[1]))):
                best = (pos, stop)
        return best

    def _follow(self, piece: str) -> None:
        """Advance each stop string's match over the new text (amortized O(1) a character)."""
        for i, stop in enumerate(self._stops):
            border, k = self._borders[i], self._matched[i]
            for c in piece:
                if k == len(stop):   # a whole match (stops not active yet): go on from its border
                    k = border[k]
                while k and stop[k] != c:
                    k = border[k]
                if stop[k] == c:
                    k += 1
            self._matched[i] = k

    def _stop_prefix_len(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of some stop string:
        what each stop's match says (never more than buf: a held prefix is all in _pending)."""
        best = 0
        for i, stop in enumerate(self._stops):
            k = self._matched[i]
            best = max(best, self._borders[i][k] if k == len(stop) else k)
        return min(best, len(buf))


def _prefix_function(stop: str) -> list[int]:
    """border[k]: the length of the longest proper prefix of stop[:k] that is also its suffix
    (k = 0 .. len(stop)), the failure links of a KMP matcher."""
    border = [0] * (len(stop) + 1)
    k = 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = border[k]
        if stop[i] == stop[k]:
            k += 1
        border[i + 1] = k
    return border
