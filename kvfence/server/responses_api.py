"""OpenAI's Responses API (`POST /v1/responses`) as a view of a chat completion.

A Responses request is translated into a chat-completions body (`chat_body`) and runs the
chat path unchanged: the same tenant key, limits, admission (I4), chat template, tools,
grammar and engine. What differs is the shape: the answer comes back as a Response object
(`ResponseView.response`), or streamed as Responses events made from the chat stream's
chunks (`ResponseView.events`).

Nothing is stored. OpenAI keeps responses for `previous_response_id`, `conversation` and
`background`; kvfence keeps no tenant's text after its request ends, so those are 400s that
say to send the conversation in `input`, and every Response says `"store": false`.
"""
from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from kvfence.server.errors import APIError, bad_request
from kvfence.server.protocol import refuse_unsupported_fields, text_of_parts, unwanted_field
from kvfence.server.tools import MAX_TOOLS

LOGPROBS_INCLUDE = "message.output_text.logprobs"
# a chat parameter named in a 400 -> the Responses field the client sent
_RENAMED = {"messages": "input", "max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
            "response_format.json_schema": "text.format", "response_format": "text.format"}
_TEXT_PARTS = {"input_text": "text", "text": "text"}
_ASSISTANT_PARTS = {**_TEXT_PARTS, "output_text": "text", "refusal": "refusal"}
_CHAT_TOOL = re.compile(r"tools\[(\d+)\]\.function\.")
# tool_choice allowed_tools: chat nests mode and tools under "allowed_tools", Responses does not
_CHAT_ALLOWED = re.compile(r"tool_choice\.allowed_tools\b")
# sampling extensions the chat path takes, passed through as vLLM's Responses route does
_PASSED = ("temperature", "top_p", "seed", "top_k", "min_p", "repetition_penalty", "presence_penalty",
           "frequency_penalty", "logit_bias", "stop", "min_tokens", "parallel_tool_calls", "top_logprobs",
           "ignore_eos", "skip_special_tokens", "include_stop_str_in_output",
           "user", "metadata")   # only echoed, but held to OpenAI's types and bounds there
# chat completions fields a Responses client may send by habit: each would be dropped below
# (what passes, as it asks for what a Response does anyway; the field to send instead)
_CHAT_ONLY: dict[str, tuple[tuple, str]] = {
    "response_format": ((), "'text.format'"), "max_tokens": ((), "'max_output_tokens'"),
    "max_completion_tokens": ((), "'max_output_tokens'"), "messages": ((), "'input'"),
    "logprobs": ((False,), "'include': [\"message.output_text.logprobs\"]"), "n": ((1,), "one answer")}
_REFUSED = {
    "previous_response_id": "kvfence stores no responses (no tenant's text outlives its request); send the whole "
                            "conversation in 'input'.",
    "conversation": "kvfence stores no conversations (no tenant's text outlives its request); send the whole "
                    "conversation in 'input'.",
    "prompt": "kvfence stores no prompt templates; send the text in 'instructions' and 'input'.",
}


class _AsSent(APIError):
    """A 400 that already names the fields as the Responses client sent them (refused()
    leaves it as it is)."""

    def __init__(self, message: str, param: str):
        super().__init__(400, message, param=param)


def renamed(param: str | None) -> str | None:
    """The Responses name of a chat parameter in a 400 ("messages[2].content" -> "input[2].content",
    "tools[1].function.parameters" -> "tools[1].parameters": Responses tools are flat)."""
    if param is None:
        return None
    if _CHAT_ALLOWED.match(param):   # "tool_choice.allowed_tools.tools[0].function.name" -> "tool_choice.tools[0].name"
        return _CHAT_TOOL.sub(r"tools[\1].", _CHAT_ALLOWED.sub("tool_choice", param))
    if _CHAT_TOOL.match(param):
        return _CHAT_TOOL.sub(r"tools[\1].", param)
    for chat, resp in _RENAMED.items():
        if param == chat or param.startswith(chat + "[") or param.startswith(chat + "."):
            return resp + param[len(chat):]
    return param


def chat_body(body: dict) -> dict:
    """The chat-completions body that answers a Responses request (400s name Responses fields)."""
    for key, why in _REFUSED.items():
        if body.get(key) is not None:
            raise bad_request(f"'{key}' is not supported: {why}", param=key)
    refuse_unsupported_fields(body)   # the chat body below would drop them silently
    chat_only = unwanted_field(body, _CHAT_ONLY)
    if chat_only is not None:
        raise _AsSent(f"'{chat_only[0]}' is a chat completions field; a Response takes {chat_only[1]}.",
                      param=chat_only[0])
    if body.get("background") not in (None, False):
        raise bad_request("'background' is not supported: kvfence stores no responses to fetch later; stream "
                          "instead.", param="background")
    if body.get("truncation") not in (None, "disabled"):
        raise bad_request("'truncation' must be 'disabled': kvfence never drops parts of a conversation; a "
                          "conversation longer than the context is a 400 (context_length_exceeded).",
                          param="truncation")
    out: dict[str, Any] = {k: body[k] for k in _PASSED if k in body}
    if "model" in body:
        out["model"] = body["model"]
    messages = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise bad_request("'instructions' must be a string.", param="instructions")
        messages.append({"role": "system", "content": instructions})
    messages += _input(body.get("input"))
    out["messages"] = messages
    if body.get("max_output_tokens") is not None:
        out["max_completion_tokens"] = body["max_output_tokens"]
    if "stream" in body:
        out["stream"] = body["stream"]
        if body["stream"] is True:
            out["stream_options"] = {"include_usage": True}   # the final event carries the usage
    # an empty 'tools' is no tools here (the Agents SDK sends [] for an agent without any), and
    # then "auto" asks for nothing; chat completions refuses [] as OpenAI's does
    if body.get("tools") not in (None, []):
        out["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None and (out.get("tools") or body["tool_choice"] != "auto"):
        out["tool_choice"] = _tool_choice(body["tool_choice"])
    fmt = _text_format(body.get("text"))
    if fmt is not None:
        out["response_format"] = fmt
    include = body.get("include")
    if include is not None:
        if not isinstance(include, list) or not all(isinstance(x, str) for x in include):
            raise bad_request("'include' must be an array of strings.", param="include")
        if LOGPROBS_INCLUDE in include:
            out["logprobs"] = True
    if "top_logprobs" in out and not out.get("logprobs"):
        if out["top_logprobs"] in (None, 0):
            del out["top_logprobs"]
        else:
            raise bad_request(f"'top_logprobs' needs 'include': [\"{LOGPROBS_INCLUDE}\"].", param="top_logprobs")
    return out


def _input(items) -> list[dict]:
    if isinstance(items, str):
        if not items:
            raise bad_request("'input' is empty.", param="input")
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise bad_request("'input' is required: a string or a non-empty array of items.", param="input")
    out: list[dict] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"'{where}' must be an object.", param=where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad_request(f"'{where}.role' must be user, assistant, system or developer.",
                                  param=f"{where}.role")
            out.append({"role": role, "content": _content(item.get("content"), f"{where}.content", role)})
        elif kind == "function_call":
            call_id, name, args = (item.get(k) for k in ("call_id", "name", "arguments"))
            if not all(isinstance(x, str) and x for x in (call_id, name)) or not isinstance(args, str):
                raise bad_request(f"'{where}' must have 'call_id', 'name' and 'arguments' (JSON text).", param=where)
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            if out and out[-1]["role"] == "assistant":   # one assistant turn: its text and its calls
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str) or not call_id:
                raise bad_request(f"'{where}.call_id' must name the call this output answers.",
                                  param=f"{where}.call_id")
            text = output if isinstance(output, str) else _content(output, f"{where}.output", "tool")
            out.append({"role": "tool", "tool_call_id": call_id, "content": text})
        elif kind == "item_reference":   # a client that believes its earlier answers are stored
            raise bad_request(f"'{where}' refers to a stored item, but this server stores no responses (they come "
                              f"back with store: false): send the item itself. With the Vercel AI SDK, set "
                              f"providerOptions.openai.store to false.", param=f"{where}.type")
        else:
            raise bad_request(f"'{where}.type' {kind!r} is not supported: input items are messages, function_call "
                              f"and function_call_output (nothing is stored to refer to, and this model reads "
                              f"text only).", param=f"{where}.type")
    return out


def _content(c, where: str, role: str) -> str:
    if isinstance(c, str):
        return c
    if not isinstance(c, list):
        raise bad_request(f"'{where}' must be a string or an array of text parts.", param=where)
    kinds = _ASSISTANT_PARTS if role == "assistant" else _TEXT_PARTS   # an answer's parts are an assistant's
    return text_of_parts(c, where, kinds, '{"type": "input_text", "text": ...}')


def _tools(tools) -> list[dict]:
    if not isinstance(tools, list):
        raise bad_request("'tools' must be an array.", param="tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else None
            raise bad_request(f"'tools[{i}]': only function tools are supported (got type {kind!r}); kvfence runs "
                              f"no hosted tools.", param=f"tools[{i}].type")
        fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if k in t}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice):
    if isinstance(choice, str):
        return choice   # none, auto, required (the chat path checks the value)
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        return {"type": "allowed_tools", "allowed_tools": {"mode": choice.get("mode"),
                                                           "tools": _allowed_tools(choice.get("tools"))}}
    raise bad_request("'tool_choice' must be 'none', 'auto', 'required', {\"type\": \"function\", \"name\": ...} or "
                      "{\"type\": \"allowed_tools\", \"mode\": ..., \"tools\": [...]}.", param="tool_choice")


def _allowed_tools(tools) -> list[dict]:
    """allowed_tools' flat function entries in the chat form; the chat path checks the mode and
    that 'tools' declares each name (its 400s renamed back by `renamed`)."""
    if not isinstance(tools, list) or not tools or len(tools) > MAX_TOOLS:
        raise bad_request(f"'tool_choice.tools' must be a non-empty array of at most {MAX_TOOLS} functions that may "
                          "be called.", param="tool_choice.tools")
    out = []
    for i, t in enumerate(tools):
        where = f"tool_choice.tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else None
            raise bad_request(f"'{where}': only function tools are supported (got type {kind!r}); kvfence runs no "
                              f"hosted tools.", param=f"{where}.type")
        if not isinstance(t.get("name"), str):
            raise bad_request(f"'{where}' must be {{\"type\": \"function\", \"name\": ...}}.", param=f"{where}.name")
        out.append({"type": "function", "function": {"name": t["name"]}})
    return out


def _text_format(text) -> dict | None:
    if text is None:
        return None
    if not isinstance(text, dict):
        raise bad_request("'text' must be an object.", param="text")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise bad_request("'text.format' must be an object.", param="text.format")
    if fmt.get("type") == "json_schema":   # Responses puts name, schema and strict beside type
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict", "description")
                                                       if k in fmt}}
    return fmt


def usage(chat_usage: dict) -> dict:
    details = chat_usage.get("prompt_tokens_details") or {}
    return {"input_tokens": chat_usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": details.get("cached_tokens", 0)},
            "output_tokens": chat_usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat_usage["total_tokens"]}


class ResponseView:
    """One request's Response object and events; the chat path's answer is its input."""

    def __init__(self, body: dict, request_id: str, model: str):
        self.body, self.model = body, model
        self.id = "resp_" + request_id.split("-", 1)[-1]
        self.created = int(time.time())
        # what was sent, or the tenant's default_max_tokens where it set none (app.py); None:
        # the rest of the context
        self.max_output_tokens: int | None = body.get("max_output_tokens")
        self._seq = 0

    # -- the Response object --------------------------------------------------------------
    def _object(self, status: str, output: list[dict], use: dict | None = None, error: dict | None = None,
                incomplete: str | None = None) -> dict:
        b = self.body
        fmt = (b.get("text") or {}).get("format") or {"type": "text"}
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "error": error, "incomplete_details": {"reason": incomplete} if incomplete else None,
                "instructions": b.get("instructions"), "max_output_tokens": self.max_output_tokens,
                "model": self.model, "output": output, "parallel_tool_calls": b.get("parallel_tool_calls", True),
                "previous_response_id": None, "reasoning": {"effort": None, "summary": None},
                "store": False, "background": False, "temperature": b.get("temperature", 1.0),
                "text": {"format": fmt}, "tool_choice": b.get("tool_choice", "auto"), "tools": b.get("tools") or [],
                "top_p": b.get("top_p", 1.0), "top_logprobs": b.get("top_logprobs"), "truncation": "disabled",
                "usage": use, "completed_at": int(time.time()) if status == "completed" else None,
                "user": b.get("user"), "metadata": b.get("metadata") or {}}

    @staticmethod
    def _status(finish: str | None) -> tuple[str, str | None]:
        return ("incomplete", "max_output_tokens") if finish == "length" else ("completed", None)

    def _message(self, text: str, logprobs: list | None, status: str = "completed", item_id: str | None = None) -> dict:
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}
        return {"type": "message", "id": item_id or "msg_" + uuid.uuid4().hex, "status": status, "role": "assistant",
                "content": [part]}

    @staticmethod
    def _call(call: dict, status: str = "completed", item_id: str | None = None) -> dict:
        return {"type": "function_call", "id": item_id or "fc_" + uuid.uuid4().hex, "call_id": call["id"],
                "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": status}

    def response(self, chat: dict) -> dict:
        """The Response object for a finished chat completion (n = 1)."""
        choice = chat["choices"][0]
        msg = choice["message"]
        output = []
        calls = msg.get("tool_calls") or []
        status, why = self._status(choice["finish_reason"])
        if msg.get("content") or not calls:
            lps = (choice.get("logprobs") or {}).get("content")
            # text that max_output_tokens cut is an incomplete item, as OpenAI marks it
            output.append(self._message(msg.get("content") or "", lps, "incomplete" if why and not calls else
                                        "completed"))
        # calls with finish_reason length are a forced answer that max_output_tokens cut: its
        # last call's arguments are unfinished, as the stream's last item says (an auto answer's
        # calls are whole, and say tool_calls)
        output += [self._call(c, "incomplete" if why and k == len(calls) - 1 else "completed")
                   for k, c in enumerate(calls)]
        return self._object(status, output, usage(chat["usage"]), incomplete=why)

    # -- events ---------------------------------------------------------------------------
    def _event(self, kind: str, **fields) -> bytes:
        data = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n".encode()

    async def events(self, chunks: AsyncGenerator[dict | str, None]) -> AsyncIterator[bytes]:
        """Responses events from the chat stream's chunks (dicts; "[DONE]" at the end)."""
        try:
            async for ev in self._events(chunks):
                yield ev
        finally:
            await chunks.aclose()   # its disconnect watcher stops now, not when collected

    async def _events(self, chunks: AsyncIterator[dict | str]) -> AsyncIterator[bytes]:
        yield self._event("response.created", response=self._object("in_progress", []))
        yield self._event("response.in_progress", response=self._object("in_progress", []))
        s = _Items(self)
        finish: str | None = None
        use: dict | None = None
        async for chunk in chunks:
            if isinstance(chunk, str):   # "[DONE]"
                break
            if "error" in chunk:
                e = chunk["error"]
                yield self._event("error", code=e.get("code"), message=e.get("message"), param=e.get("param"))
                yield self._event("response.failed", response=self._object(
                    "failed", s.output, error={"code": e.get("code") or "server_error", "message": e.get("message")}))
                return
            if chunk.get("usage"):
                use = usage(chunk["usage"])
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                for ev in s.text(delta.get("content") or "", (choice.get("logprobs") or {}).get("content") or []):
                    yield ev
                for d in delta.get("tool_calls") or []:
                    for ev in s.call(d):
                        yield ev
                finish = choice.get("finish_reason") or finish
        status, why = self._status(finish)
        for ev in s.close(cut=why is not None):
            yield ev
        final = self._object(status, s.output, use, incomplete=why)
        yield self._event("response.completed" if status == "completed" else "response.incomplete", response=final)


class _Items:
    """The output items of one streamed response: a message item while text comes, then one
    function_call item per call; each opened, filled and closed with its events."""

    def __init__(self, view: ResponseView):
        self.v = view
        self.output: list[dict] = []         # closed items, in order
        self._text: dict | None = None       # the open message: id, index, text, logprobs
        self._calls: dict[int, dict] = {}    # open calls by their chat index: id, index, call_id, name, arguments

    def _next_index(self) -> int:
        return len(self.output) + (self._text is not None) + len(self._calls)

    def text(self, piece: str, lps: list) -> list[bytes]:
        if not piece and not lps:
            return []
        ev = []
        if self._text is None:
            ev += self._open_text()
        t = self._text
        assert t is not None
        t["text"] += piece
        t["logprobs"] += lps
        return ev + [self.v._event("response.output_text.delta", item_id=t["id"], output_index=t["index"],
                                   content_index=0, delta=piece, logprobs=lps)]

    def _open_text(self) -> list[bytes]:
        t = self._text = {"id": "msg_" + uuid.uuid4().hex, "index": self._next_index(), "text": "", "logprobs": []}
        item = {**self.v._message("", [], "in_progress", t["id"]), "content": []}
        part = self.v._message("", [])["content"][0]
        return [self.v._event("response.output_item.added", output_index=t["index"], item=item),
                self.v._event("response.content_part.added", item_id=t["id"], output_index=t["index"],
                              content_index=0, part=part)]

    def _close_text(self, status: str = "completed") -> list[bytes]:
        t, self._text = self._text, None
        if t is None:
            return []
        item = self.v._message(t["text"], t["logprobs"], status, item_id=t["id"])
        self.output.append(item)
        return [self.v._event("response.output_text.done", item_id=t["id"], output_index=t["index"], content_index=0,
                              text=t["text"], logprobs=t["logprobs"]),
                self.v._event("response.content_part.done", item_id=t["id"], output_index=t["index"],
                              content_index=0, part=item["content"][0]),
                self.v._event("response.output_item.done", output_index=t["index"], item=item)]

    def call(self, d: dict) -> list[bytes]:
        """A chat tool-call delta: {index, id, function: {name, arguments}} on a call's first
        delta, {index, function: {arguments}} after (or a whole call at once)."""
        ev = self._close_text()
        k = d.get("index", 0)
        fn = d.get("function") or {}
        c = self._calls.get(k)
        if c is None:   # a call begins: the one before it is whole (each item ends before the next, as OpenAI's)
            for before in sorted(self._calls):
                ev += self._close_call(before, "completed")
            c = self._calls[k] = {"id": "fc_" + uuid.uuid4().hex, "index": self._next_index(),
                                  "call_id": d.get("id") or "", "name": fn.get("name") or "", "arguments": ""}
            ev.append(self.v._event("response.output_item.added", output_index=c["index"],
                                    item=self._item(c, "in_progress", "")))
        args = fn.get("arguments") or ""
        if args:
            c["arguments"] += args
            ev.append(self.v._event("response.function_call_arguments.delta", item_id=c["id"],
                                    output_index=c["index"], delta=args))
        return ev

    def _item(self, c: dict, status: str, arguments: str) -> dict:
        return self.v._call({"id": c["call_id"], "function": {"name": c["name"], "arguments": arguments}}, status,
                            c["id"])

    def close(self, cut: bool = False) -> list[bytes]:
        """Close what is open; an answer with no text and no call is still one (empty) message.
        cut: max_output_tokens ended it, so the last item (what was being written) is incomplete."""
        ev = []
        if self._text is None and not self._calls and not self.output:
            ev += self._open_text()
        ev += self._close_text("incomplete" if cut and not self._calls else "completed")
        last = max(self._calls, default=None)
        for k in sorted(self._calls):
            ev += self._close_call(k, "incomplete" if cut and k == last else "completed")
        return ev

    def _close_call(self, k: int, status: str) -> list[bytes]:
        c = self._calls.pop(k)
        item = self._item(c, status, c["arguments"])
        self.output.append(item)
        return [self.v._event("response.function_call_arguments.done", item_id=c["id"], output_index=c["index"],
                              name=c["name"], arguments=c["arguments"]),
                self.v._event("response.output_item.done", output_index=c["index"], item=item)]


def refused(e: APIError) -> APIError:
    """A chat-path 400 re-addressed to the Responses fields the client sent, in its param and
    its message."""
    if isinstance(e, _AsSent):
        return e
    e.param = renamed(e.param)
    e.message = _CHAT_TOOL.sub(r"tools[\1].", _CHAT_ALLOWED.sub("tool_choice", e.message))
    for chat, resp in _RENAMED.items():
        e.message = e.message.replace(f"'{chat}", f"'{resp}")
    return e
