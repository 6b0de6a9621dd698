"""OpenAI's deprecated function calling (`functions`, `function_call`, `function` messages), as a
view of tools: a request in that form is rewritten into `tools` before it is parsed, and its
answer is written back in that form (openai_format.Formatter: `message.function_call`,
`delta.function_call`, finish_reason "function_call"). LiteLLM passes `functions=` through
unchanged, as do older LangChain chains and instructor's FUNCTIONS mode; OpenAI still serves
them. One call per answer, as that form holds one.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from typing import TypeVar

from kvfence.server.errors import APIError, bad_request

T = TypeVar("T")


def parsed(body: dict, parse: Callable[[dict], T]) -> tuple[T, bool]:
    """(`parse` of the body read as tools, whether it was sent in the legacy form); a refusal
    names the fields as sent: functions[0].name, not tools[0].function.name."""
    body, legacy = as_tools(body)
    try:
        return parse(body), legacy
    except APIError as e:
        raise (named_as_sent(e) if legacy else e) from None


def as_tools(body: dict) -> tuple[dict, bool]:
    """(the body with `functions`, `function_call` and the messages' legacy parts written as
    tools, whether the answer must come back in the legacy form)."""
    fns, call = body.get("functions"), body.get("function_call")
    msgs = body.get("messages")
    legacy_msgs = isinstance(msgs, list) and any(
        isinstance(m, dict) and (m.get("role") == "function" or m.get("function_call") is not None) for m in msgs)
    if fns is None and call is None and not legacy_msgs:
        return body, False
    out = {k: v for k, v in body.items() if k not in ("functions", "function_call")}
    if fns is not None:
        if body.get("tools") is not None:
            raise bad_request("Send 'tools' or the deprecated 'functions', not both.", param="functions")
        if not isinstance(fns, list):
            raise bad_request("'functions' must be an array of {\"name\", \"description\", \"parameters\"}.",
                              param="functions")
        out["tools"] = [{"type": "function", "function": f} for f in fns]
        out["parallel_tool_calls"] = False
    if call is not None:
        if fns is None:
            raise bad_request("'function_call' needs 'functions'.", param="function_call")
        if body.get("tool_choice") is not None:
            raise bad_request("Send 'tool_choice' or the deprecated 'function_call', not both.", param="function_call")
        if call in ("none", "auto"):
            out["tool_choice"] = call
        elif isinstance(call, dict) and isinstance(call.get("name"), str):
            out["tool_choice"] = {"type": "function", "function": {"name": call["name"]}}
        else:
            raise bad_request("'function_call' must be 'none', 'auto' or {\"name\": ...}.", param="function_call")
    if legacy_msgs and isinstance(msgs, list):
        out["messages"] = _messages(msgs)
    return out, fns is not None


def _messages(msgs: list) -> list:
    """An assistant's `function_call` as its one tool call, and a `function` message as the
    `tool` message answering the call before it (the legacy form has no call ids)."""
    out, last_id = [], None
    for i, m in enumerate(msgs):
        if isinstance(m, dict) and m.get("role") == "assistant" and m.get("function_call") is not None:
            fc = m["function_call"]
            if not (isinstance(fc, dict) and isinstance(fc.get("name"), str) and isinstance(fc.get("arguments"), str)):
                raise bad_request(f"'messages[{i}].function_call' must be {{\"name\": ..., \"arguments\": \"...\"}}.",
                                  param=f"messages[{i}].function_call")
            if m.get("tool_calls"):
                raise bad_request(f"'messages[{i}]' has both 'function_call' and 'tool_calls'; send one.",
                                  param=f"messages[{i}].function_call")
            last_id = f"call_fn{i}"
            m = {**{k: v for k, v in m.items() if k != "function_call"},
                 "tool_calls": [{"id": last_id, "type": "function", "function": m["function_call"]}]}
        elif isinstance(m, dict) and m.get("role") == "function":
            if last_id is None:
                raise bad_request(f"'messages[{i}]' is a function result, but no assistant 'function_call' comes "
                                  "before it.", param=f"messages[{i}]")
            m = {"role": "tool", "tool_call_id": last_id, "content": m.get("content")}
        out.append(m)
    return out


# the rewritten fields, as quoted in messages and as params: tools[i].function.x is functions[i].x
_QUOTED = ((re.compile(r"'tools\[(\d+)\]\.function\.([^']*)'"), r"'functions[\1].\2'"),
           (re.compile(r"'tools\[(\d+)\]([^']*)'"), r"'functions[\1]\2'"),
           (re.compile(r"'tools'"), "'functions'"),
           (re.compile(r"^'tool_choice'"), "'function_call'"))   # a function may be called tool_choice


def _param(param: str | None) -> str | None:
    if param is None:
        return None
    for pattern, repl in _QUOTED:
        param = pattern.sub(repl, f"'{param}'")[1:-1] if pattern.fullmatch(f"'{param}'") else param
    return param


def named_as_sent(e: APIError) -> APIError:
    """A refusal of the rewritten tools, naming the fields the client sent (only quoted field
    paths are renamed: a function may be called tool_choice)."""
    message = e.message
    for pattern, repl in _QUOTED:
        message = pattern.sub(repl, message)
    return APIError(e.status, message, code=e.code, param=_param(e.param), headers=e.headers, outcome=e.outcome)
