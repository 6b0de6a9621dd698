"""Responses and stream chunks in the OpenAI API's shapes."""
from __future__ import annotations

import json
import time

from kvfence.server.backend import Logprob


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


class Formatter:
    """Builds the bodies for one request: same id, model and creation time in every chunk."""

    def __init__(self, kind: str, request_id: str, model: str, fingerprint: str, token_text):
        self.kind, self.id, self.model, self.fingerprint = kind, request_id, model, fingerprint
        self.created = int(time.time())
        self._token_text = token_text   # token id -> its text, for logprobs
        self._offset = 0                # completions' text_offset runs across chunks

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint}

    # -- whole responses -----------------------------------------------------------------
    def response(self, text: str, finish_reason: str, lps: list[Logprob] | None, use: dict) -> dict:
        if self.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": self._chat_logprobs(lps), "finish_reason": finish_reason}
            return {**self._head("chat.completion"), "choices": [choice], "usage": use}
        choice = {"index": 0, "text": text, "logprobs": self._completion_logprobs(lps),
                  "finish_reason": finish_reason}
        return {**self._head("text_completion"), "choices": [choice], "usage": use}

    # -- stream chunks -------------------------------------------------------------------
    def chunk(self, text: str, finish_reason: str | None, lps: list[Logprob] | None, with_usage: bool,
              first: bool = False) -> dict:
        if self.kind == "chat":
            delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "logprobs": self._chat_logprobs(lps),
                      "finish_reason": finish_reason}
            body = {**self._head("chat.completion.chunk"), "choices": [choice]}
        else:
            choice = {"index": 0, "text": text, "logprobs": self._completion_logprobs(lps),
                      "finish_reason": finish_reason}
            body = {**self._head("text_completion"), "choices": [choice]}
        if with_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, use: dict) -> dict:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._head(obj), "choices": [], "usage": use}

    # -- logprobs ------------------------------------------------------------------------
    def _chat_logprobs(self, lps: list[Logprob] | None) -> dict | None:
        if lps is None:
            return None
        def entry(tid: int, lp: float) -> dict:
            s = self._token_text(tid)
            return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}
        return {"content": [{**entry(x.token_id, x.logprob), "top_logprobs": [entry(t, v) for t, v in x.top]}
                            for x in lps], "refusal": None}

    def _completion_logprobs(self, lps: list[Logprob] | None) -> dict | None:
        if lps is None:
            return None
        tokens, offsets = [], []
        for x in lps:
            s = self._token_text(x.token_id)
            tokens.append(s)
            offsets.append(self._offset)
            self._offset += len(s)
        tops = [{self._token_text(t): v for t, v in x.top} for x in lps]
        return {"tokens": tokens, "token_logprobs": [x.logprob for x in lps], "top_logprobs": tops,
                "text_offset": offsets}


def sse(obj: dict | str) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n".encode()
