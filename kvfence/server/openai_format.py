"""Responses and stream chunks in the OpenAI API's shapes."""
from __future__ import annotations

import codecs
import json
import time
from collections.abc import Callable

from kvfence.server.backend import Logprob


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens},
            "completion_tokens_details": {"reasoning_tokens": 0}}   # as OpenAI's: this model does not reason apart


class Formatter:
    """Builds the bodies for one request: same id, model and creation time in every chunk."""

    def __init__(self, kind: str, request_id: str, model: str, fingerprint: str, token_text: Callable[[int], str],
                 token_bytes: Callable[[int], bytes] | None = None, legacy_functions: bool = False):
        self.kind, self.id, self.model, self.fingerprint = kind, request_id, model, fingerprint
        # the request sent `functions`: its one call comes back as `function_call` (legacy_functions.py)
        self.legacy_functions = legacy_functions
        self.created = int(time.time())
        self._token_text = token_text   # token id -> its text, for logprobs
        # token id -> its own bytes: a token holding part of a character has no text of its own
        # ("\ufffd"), and clients rebuild the text from logprobs' bytes
        self._token_bytes = token_bytes or (lambda tid: token_text(tid).encode("utf-8"))
        self._offset: dict[int, _Offsets] = {}   # per choice: completions' text_offset runs across chunks
        self._prompt: dict[int, tuple[int, list[Logprob]]] = {}   # per choice: echoed prompt logprobs, not yet sent

    def start_offset(self, index: int, chars: int) -> None:
        """Choice `index`'s text starts with `chars` characters of echoed prompt."""
        self._offset[index] = _Offsets(chars)

    def prompt_logprobs(self, index: int, first_token: int, lps: list[Logprob]) -> None:
        """Choice `index`'s next completion logprobs start with its echoed prompt's: the
        first token's (null: nothing comes before it, as OpenAI and vLLM answer) and then
        `lps`, at text offsets from 0."""
        self._prompt[index] = (first_token, list(lps))

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint}

    # -- whole responses -----------------------------------------------------------------
    def response(self, choices: list[tuple[str | None, str, list[Logprob] | None, list[dict] | None]],
                 use: dict) -> dict:
        """choices: (text, finish reason, logprobs, tool calls) by index."""
        if self.kind == "chat":
            # refusal null: the fields OpenAI's message always has (clients in other languages read them)
            out = [{"index": i, "message": {"role": "assistant", "content": text, "refusal": None,
                                            **self._calls(calls)},
                    "logprobs": self._chat_logprobs(lps), "finish_reason": self._reason(reason)}
                   for i, (text, reason, lps, calls) in enumerate(choices)]
            return {**self._head("chat.completion"), "choices": out, "usage": use}
        out = [{"index": i, "text": text, "logprobs": self._completion_logprobs(lps, i), "finish_reason": reason}
               for i, (text, reason, lps, _) in enumerate(choices)]
        return {**self._head("text_completion"), "choices": out, "usage": use}

    # -- stream chunks -------------------------------------------------------------------
    def chunk(self, text: str | None, finish_reason: str | None, lps: list[Logprob] | None, with_usage: bool,
              first: bool = False, index: int = 0, tool_calls: list[dict] | None = None,
              call_deltas: list[dict] | None = None) -> dict:
        if self.kind == "chat":
            delta: dict = ({"role": "assistant", "content": text, "refusal": None} if first else
                           {"content": text} if text else {})
            if tool_calls:   # whole calls in one delta, each with its position
                delta.update(self._calls([{"index": k, **call} for k, call in enumerate(tool_calls)]))
            elif call_deltas:   # pieces of calls, each naming its call's index (tools.CallStream)
                delta.update(self._calls(call_deltas))
            choice = {"index": index, "delta": delta, "logprobs": self._chat_logprobs(lps),
                      "finish_reason": self._reason(finish_reason)}
            body = {**self._head("chat.completion.chunk"), "choices": [choice]}
        else:
            choice = {"index": index, "text": text, "logprobs": self._completion_logprobs(lps, index),
                      "finish_reason": finish_reason}
            body = {**self._head("text_completion"), "choices": [choice]}
        if with_usage:
            body["usage"] = None
        return body

    def _calls(self, calls: list[dict] | None) -> dict:
        """A message's or delta's calls: `tool_calls`, or the legacy form's one `function_call`
        (its name and arguments, or their pieces; the call is the only one: parallel is off)."""
        if not calls:
            return {}
        if self.legacy_functions:   # every piece of it in this delta, joined: a head and its first arguments
            fn: dict = {}
            for call in calls:
                part = call.get("function") or {}
                if "name" in part:
                    fn["name"] = part["name"]
                if "arguments" in part:
                    fn["arguments"] = fn.get("arguments", "") + part["arguments"]
            return {"function_call": fn}
        return {"tool_calls": calls}

    def _reason(self, reason: str | None) -> str | None:
        return "function_call" if self.legacy_functions and reason == "tool_calls" else reason

    def usage_chunk(self, use: dict) -> dict:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._head(obj), "choices": [], "usage": use}

    # -- logprobs ------------------------------------------------------------------------
    def _chat_logprobs(self, lps: list[Logprob] | None) -> dict | None:
        if lps is None:
            return None
        def entry(tid: int, lp: float) -> dict:
            return {"token": self._token_text(tid), "logprob": lp, "bytes": list(self._token_bytes(tid))}
        return {"content": [{**entry(x.token_id, x.logprob), "top_logprobs": [entry(t, v) for t, v in x.top]}
                            for x in lps], "refusal": None}

    def _completion_logprobs(self, lps: list[Logprob] | None, index: int = 0) -> dict | None:
        if lps is None:
            return None
        tokens: list[str] = []
        values: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        offsets: list[int] = []
        if index in self._prompt:
            first, prompt = self._prompt.pop(index)
            at = _Offsets(0)
            for tid, x in [(first, None), *((p.token_id, p) for p in prompt)]:
                tokens.append(self._token_text(tid))
                values.append(None if x is None else x.logprob)
                tops.append(None if x is None else self._top_with_chosen(x))
                offsets.append(at.take(self._token_bytes(tid)))
        at = self._offset.setdefault(index, _Offsets(0))
        for x in lps:
            tokens.append(self._token_text(x.token_id))
            values.append(x.logprob)
            tops.append(self._top_with_chosen(x))
            offsets.append(at.take(self._token_bytes(x.token_id)))
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}

    def _top_with_chosen(self, x: Logprob) -> dict[str, float]:
        """The completions API's top_logprobs entry: the `logprobs` likeliest tokens and always
        the chosen one, so up to logprobs + 1 (as OpenAI's legacy API and vLLM answer; with
        logprobs 0 each entry was {}, and a client taking its argmax failed)."""
        top = {self._token_text(t): v for t, v in x.top}
        top.setdefault(self._token_text(x.token_id), x.logprob)
        return top


def sse(obj: dict | str) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


class _Offsets:
    """text_offset, in characters of the text the client gets, token after token: a token's
    offset is the characters completed before it (one that continues a character points at
    that character). Summing each token's own text counted a partial character as one
    "\ufffd" and ran ahead of the text."""

    def __init__(self, chars: int):
        self.chars = chars
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def take(self, token_bytes: bytes) -> int:
        at = self.chars
        self.chars += len(self._utf8.decode(token_bytes))
        return at
