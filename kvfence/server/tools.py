"""Tools (function calling) for /v1/chat/completions: OpenAI's `tools`, `tool_choice` and
`parallel_tool_calls`, the conversation's tool calls and results, and the model's answer as
`tool_calls`.

Rendering: a model whose chat template reads `tools` gets them through its template (and
`tool` messages as they are); otherwise (the bundled SmolLM2's template knows nothing of
tools) a generic prompt: a system message listing each function with its JSON parameter
schema and asking for calls as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
earlier calls written back in that form, and results as user messages that name the call.

Enforcement: with `tool_choice` "required" or a named function, the output is held by the
engine's grammar (kvfence/engine/grammar.py) to a JSON schema that admits only calls of the
allowed functions with arguments valid for their parameters (an array of them when
`parallel_tool_calls` is on), so it always parses into valid calls; cut short by max_tokens,
the calls begun (a name closed) are still calls, the last one's arguments unfinished, as the
stream sent them (CallStream). With "auto" the model chooses freely; only text that is a
well-formed call of an allowed function becomes a `tool_calls` entry, the rest is content.
With "auto" and a response_format the grammar admits the format's answer or one call as bare
JSON (call_or_answer_schema). With "none" the tools are not shown to the model.

`tool_choice` {"type": "allowed_tools", "allowed_tools": {"mode", "tools"}} is "auto" or
"required" over a subset of the declared functions (ToolSpec.only): every declared function
is still shown to the model (OpenAI keeps the whole list in the prompt, so a conversation
that changes the subset keeps its prompt's prefix), with a sentence naming the ones it may
call; only those can be called (the grammar under "required", parsing under "auto").
"""
from __future__ import annotations

import json
import logging
import re
import uuid
from dataclasses import dataclass

from kvfence.engine.schema_leniency import held_as
from kvfence.server.errors import JSON_ERRORS, bad_request
from kvfence.server.schema_parts import SchemaParts

log = logging.getLogger("kvfence.server")

MAX_TOOLS = 64
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_TAG = "<tool_call>"   # an auto answer's call begins with it (the generic prompt asks for it)
_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)


@dataclass
class ToolSpec:
    tools: list[dict]                 # [{"name", "description", "parameters", "strict"}]
    choice: str                       # "none" | "auto" | "required" | "function"
    name: str | None = None           # tool_choice's function, when choice == "function"
    parallel: bool = True
    # "auto" with a response_format: the grammar admits the format's answer or one call as bare
    # JSON (OpenAI's response_format governs text, not calls); this is the format's schema
    answer_schema: str | None = None
    # tool_choice allowed_tools: the functions that may be called ("auto" or "required" over them)
    only: frozenset[str] | None = None

    @property
    def active(self) -> bool:
        return bool(self.tools) and self.choice != "none"

    @property
    def enforced(self) -> bool:
        return self.choice in ("required", "function")

    def allowed(self) -> list[dict]:
        """The functions that may be called."""
        if self.choice == "function":
            return [t for t in self.tools if t["name"] == self.name]
        return [t for t in self.tools if self.only is None or t["name"] in self.only]

    def shown(self) -> list[dict]:
        """The functions the prompt lists: under allowed_tools every declared one (the prompt
        then names the allowed ones), else the ones that may be called."""
        return self.tools if self.only is not None else self.allowed()


def parse_tools(body: dict) -> ToolSpec | None:
    """The request's tools, or None; every malformed part is a 400 that names it."""
    for legacy in ("functions", "function_call"):
        if body.get(legacy) is not None:
            raise bad_request(f"'{legacy}' is OpenAI's deprecated form; send 'tools' and 'tool_choice' instead.",
                              param=legacy)
    raw = body.get("tools")
    choice_raw = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")   # null is absent here, as for OpenAI
    parallel = True if parallel is None else parallel
    if not isinstance(parallel, bool):
        raise bad_request("'parallel_tool_calls' must be a boolean.", param="parallel_tool_calls")
    if raw is None:
        if choice_raw not in (None, "none"):
            raise bad_request("'tool_choice' needs 'tools'.", param="tool_choice")
        return None
    if not isinstance(raw, list) or not raw:
        raise bad_request("'tools' must be a non-empty array of {\"type\": \"function\", \"function\": {...}}.",
                          param="tools")
    if len(raw) > MAX_TOOLS:
        raise bad_request(f"'tools' may hold at most {MAX_TOOLS} functions.", param="tools")
    tools, seen = [], set()
    for i, t in enumerate(raw):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise bad_request(f"'{where}' must be {{\"type\": \"function\", \"function\": {{...}}}}.", param=where)
        f = t["function"]
        name = f.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise bad_request(f"'{where}.function.name' must be 1-64 letters, digits, '_' or '-'.",
                              param=f"{where}.function.name")
        if name in seen:
            raise bad_request(f"'{where}.function.name' {name!r} is declared twice.", param=f"{where}.function.name")
        seen.add(name)
        desc = f.get("description")
        desc = "" if desc is None else desc
        if not isinstance(desc, str):
            raise bad_request(f"'{where}.function.description' must be a string.",
                              param=f"{where}.function.description")
        params = f.get("parameters")
        params = {"type": "object", "properties": {}} if params is None else params
        if not isinstance(params, dict):
            raise bad_request(f"'{where}.function.parameters' must be a JSON Schema object.",
                              param=f"{where}.function.parameters")
        strict = f.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise bad_request(f"'{where}.function.strict' must be a boolean.", param=f"{where}.function.strict")
        # strict: what the grammar cannot hold in its parameters is refused, not left unenforced
        tools.append({"name": name, "description": desc, "parameters": params, "strict": strict is True})
    name, only = None, None
    if choice_raw is None:
        choice = "auto"
    elif isinstance(choice_raw, str) and choice_raw in ("none", "auto", "required"):
        choice = choice_raw
    elif isinstance(choice_raw, dict) and choice_raw.get("type") == "allowed_tools":
        choice, only = _allowed_tools(choice_raw.get("allowed_tools"), seen)
    elif isinstance(choice_raw, dict) and choice_raw.get("type") == "function" and isinstance(
            choice_raw.get("function"), dict) and isinstance(choice_raw["function"].get("name"), str):
        choice, name = "function", choice_raw["function"]["name"]
        if name not in seen:
            raise bad_request(f"'tool_choice' names function {name!r}, which 'tools' does not declare.",
                              param="tool_choice")
    else:
        raise bad_request("'tool_choice' must be 'none', 'auto', 'required', {\"type\": \"function\", "
                          "\"function\": {\"name\": ...}} or {\"type\": \"allowed_tools\", \"allowed_tools\": "
                          "{\"mode\": ..., \"tools\": [...]}}.", param="tool_choice")
    return ToolSpec(tools, choice, name, parallel, only=only)


def _allowed_tools(raw, declared: set[str]) -> tuple[str, frozenset[str]]:
    """tool_choice allowed_tools' (mode, names): "auto" or "required" over the functions it
    lists, each one that 'tools' declares (a name listed twice counts once)."""
    where = "tool_choice.allowed_tools"
    if not isinstance(raw, dict):
        raise bad_request(f"'{where}' must be {{\"mode\": \"auto\" | \"required\", \"tools\": "
                          f"[{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, ...]}}.", param=where)
    mode = raw.get("mode")
    if not isinstance(mode, str) or mode not in ("auto", "required"):
        raise bad_request(f"'{where}.mode' must be 'auto' or 'required'.", param=f"{where}.mode")
    listed = raw.get("tools")
    if not isinstance(listed, list) or not listed or len(listed) > MAX_TOOLS:
        raise bad_request(f"'{where}.tools' must be a non-empty array of at most {MAX_TOOLS} functions that may be "
                          "called.", param=f"{where}.tools")
    names = set()
    for i, t in enumerate(listed):
        at = f"{where}.tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict) \
                or not isinstance(t["function"].get("name"), str):
            raise bad_request(f"'{at}' must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}} "
                              f"(only function tools run here).", param=at)
        name = t["function"]["name"]
        if name not in declared:
            raise bad_request(f"'{at}.function.name' names function {name!r}, which 'tools' does not declare.",
                              param=f"{at}.function.name")
        names.add(name)
    return mode, frozenset(names)


def call_schema(spec: ToolSpec) -> dict:
    """What an enforced answer must be: a call (or, with parallel calls, a non-empty array
    of calls) of an allowed function, with arguments valid for its parameters. Each tool's
    definitions (pydantic's nested models) move to the root's $defs (schema_parts.py)."""
    parts = SchemaParts()
    return parts.root(_calls(spec, parts, array=spec.parallel and spec.choice == "required"))


def call_or_answer_schema(spec: ToolSpec, answer_schema: str) -> dict:
    """What an "auto" answer with a response_format must be: the format's answer, or one call
    of a declared function."""
    parts = SchemaParts()
    return parts.root({"anyOf": [parts.add(json.loads(answer_schema), "answer"), _calls(spec, parts, array=False)]})


def enforced_parameters(tool: dict) -> dict:
    """A tool's parameters as the grammar holds them: without what a tool that is not strict
    goes without (schema_leniency.held_as)."""
    return held_as(tool["parameters"], tool.get("strict") is True)


def _calls(spec: ToolSpec, parts: SchemaParts, array: bool) -> dict:
    calls = [{"type": "object", "properties": {"name": {"const": t["name"]},
                                               "arguments": parts.add(enforced_parameters(t), f"tool{k}")},
              "required": ["name", "arguments"], "additionalProperties": False}
             for k, t in enumerate(spec.allowed())]
    one = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return {"type": "array", "items": one, "minItems": 1, "maxItems": 8} if array else one


_BARE_CALL = ('To call a function, answer with only {"name": "<function>", "arguments": {...}}; otherwise answer in '
              "the requested JSON format.")


def _generic_prompt(spec: ToolSpec) -> str:
    lines = ["You can call these functions. Each takes JSON arguments that follow its schema:"]
    for t in spec.shown():
        lines.append(f"- {t['name']}: {t['description'] or '(no description)'}\n  parameters: "
                     f"{json.dumps(t['parameters'], separators=(',', ':'))}")
    if spec.answer_schema is not None:
        lines.append(_BARE_CALL)
    else:
        lines.append('To call a function, answer with <tool_call>{"name": "<function>", "arguments": {...}}'
                     "</tool_call> and nothing else" + (" (one tag per call)" if spec.parallel else "") + ".")
    if spec.only is not None:
        lines.append(_only_note(spec))
    elif spec.enforced:
        lines.append("You must call a function now." if spec.choice == "required"
                     else f"You must call {spec.name} now.")
    return "\n".join(lines)


def _only_note(spec: ToolSpec) -> str:
    """allowed_tools: which of the listed functions may be called now (last in the prompt, so
    the list before it is the same whatever the subset)."""
    names = ", ".join(t["name"] for t in spec.allowed())
    if spec.choice == "required":
        return f"You must call one of these functions now: {names}."
    return f"Only these functions may be called now: {names}."


def render(messages: list[dict], spec: ToolSpec | None, template_has_tools: bool,
           template_has_developer: bool = False) -> tuple[list[dict], list | None]:
    """Messages for the chat template (role and content only, unless the template reads
    tools), and the tools to pass it (None: the generic prompt is in the messages). A
    "developer" message is OpenAI's system message: for a template that does not know the
    role it is rendered as one."""
    if not template_has_developer:
        messages = [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]
    if template_has_tools and spec is not None and spec.active:
        if spec.answer_schema is not None:   # the template asks for its own call form, which the grammar forbids
            messages = _with_system(list(messages), _BARE_CALL)
        if spec.only is not None:            # the template lists every declared function
            messages = _with_system(list(messages), _only_note(spec))
        return messages, [{"type": "function", "function": t} for t in spec.shown()]
    out: list[dict] = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = "".join(f"<tool_call>{json.dumps({'name': c['name'], 'arguments': c['arguments']})}</tool_call>"
                            for c in m["tool_calls"])
            out.append({"role": "assistant", "content": (m["content"] or "") + calls})
        elif m["role"] == "tool":
            out.append({"role": "user", "content": f"Result of tool call {m.get('tool_call_id')}: {m['content']}"})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    if spec is not None and spec.active:
        out = _with_system(out, _generic_prompt(spec))
    return out, None


def _with_system(messages: list[dict], text: str) -> list[dict]:
    """text added to the first system message, or as one."""
    if messages and messages[0]["role"] in ("system", "developer"):   # developer: a template that knows it
        return [{**messages[0], "content": messages[0]["content"] + "\n\n" + text}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def _call(obj, spec: ToolSpec) -> dict | None:
    """An OpenAI tool call from a parsed {"name", "arguments"}, or None. Arguments written as
    a JSON string holding an object are taken too (models trained on OpenAI's wire form write
    them so); they go out as compact JSON, as the streamed calls' text is."""
    if not (isinstance(obj, dict) and isinstance(obj.get("name"), str)):
        return None
    args = obj.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except JSON_ERRORS:
            return None
    if not isinstance(args, dict) or obj["name"] not in {t["name"] for t in spec.allowed()}:
        return None
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False, separators=(",", ":"))}}


def _cut_calls(text: str, spec: ToolSpec) -> list[dict]:
    """An enforced answer cut short by max_tokens, as the stream sent it (CallStream): every
    call whose name is closed, the finished ones whole, the last one with its arguments so far
    (not valid JSON, as OpenAI returns a cut call, so a client sees it is cut: finish_reason
    is length). Arguments are the text as generated, the stream's pieces added up."""
    calls: list[dict] = []
    for d in CallStream().feed(text):
        if "id" in d:
            calls.append({"id": d["id"], "type": "function", "function": dict(d["function"])})
        else:
            calls[d["index"]]["function"]["arguments"] += d["function"]["arguments"]
    allowed = {t["name"] for t in spec.allowed()}
    return [c for c in calls if c["function"]["name"] in allowed]   # the grammar admits no other


def _named_by_start(text: str, spec: ToolSpec) -> list[str]:
    """The allowed functions whose call the enforced grammar may be writing, when `text` is
    all it wrote before its first name closed ('[{"name":"get_')."""
    return [t["name"] for t in spec.allowed()
            if any(head.startswith(text) for head in (f'[{{"name":"{t["name"]}"', f'{{"name":"{t["name"]}"'))]


def call_cut_before_its_name(text: str, spec: ToolSpec) -> dict | None:
    """An enforced answer cut by max_tokens before its first call's name closed: that text is
    the server's grammar, never the assistant's content. When one allowed function fits what
    was written, it is the call (OpenAI names a forced call whatever cut it), no arguments yet;
    else there is no call to name (None: no content and no call, finish_reason length)."""
    names = _named_by_start(text, spec)
    if len(names) != 1:
        return None
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": names[0], "arguments": ""}}


def enforced_answer_whole(text: str) -> bool:
    """Whether an enforced answer is all its grammar asked for (it parses) or was cut (by
    max_tokens, a stop string or a stop token): only a whole one says finish_reason tool_calls."""
    try:
        json.loads(text)
    except JSON_ERRORS:
        return False
    return True


def parse_answer(text: str, spec: ToolSpec) -> tuple[str | None, list[dict] | None]:
    """(content, tool_calls) of a finished answer. Text nested deeper than the JSON parser
    recurses (a recursive $ref grammar allows it) is read as text, like any that does not parse."""
    if spec.enforced:   # the grammar held it to call_schema: it parses, unless max_tokens cut it
        try:
            obj = json.loads(text)
        except JSON_ERRORS:   # cut short: the calls begun, as streamed
            if cut := _cut_calls(text, spec):
                return None, cut
            if not _named_by_start(text, spec):   # not the grammar's start: text (not expected)
                return text, None
            named = call_cut_before_its_name(text, spec)
            return None, None if named is None else [named]
        calls = [c for c in (_call(o, spec) for o in (obj if isinstance(obj, list) else [obj])) if c]
        return (None, calls) if calls else (text, None)
    if spec.answer_schema is not None:   # the grammar held it to the format's answer or one bare call
        try:
            obj = json.loads(text)
        except JSON_ERRORS:
            return text, None
        # the call branch writes exactly {"name", "arguments": {...}}; an answer the format allows
        # in that very shape is taken as the call too (only the call branch checked its arguments)
        exact = isinstance(obj, dict) and list(obj) == ["name", "arguments"] and isinstance(obj["arguments"], dict)
        call = _call(obj, spec) if exact else None
        return (None, [call]) if call is not None else (text, None)
    found, kept, at = [], [], 0
    for m in _CALL.finditer(text):
        try:
            c = _call(json.loads(m.group(1)), spec)
        except JSON_ERRORS:
            c = None
        if c is not None:   # a call leaves the content; a tag that is none (e.g. of a function
            found.append(c)  # not allowed under allowed_tools) stays in it
            kept.append(text[at:m.start()])
            at = m.end()
    rest = "".join(kept) + text[at:]
    # a last call whose closing tag never came (the model stopped right after its JSON)
    head, tag, tail = rest.rpartition(_TAG)
    if tag:
        try:
            last = _call(json.loads(tail), spec)
        except JSON_ERRORS:
            last = None
        if last is not None:
            found.append(last)
            rest = head
    if not found:
        return text, None
    if not spec.parallel:
        found = found[:1]
    # the text before the first tag is content as generated (TextBeforeCalls streams it), less
    # the whitespace before the call; only whitespace there, and the content is what follows
    before = text[:text.find(_TAG)]
    content = rest.rstrip() if before.strip() else rest.strip()
    return content or None, found


class TextBeforeCalls:
    """An auto answer's content streamed as it is generated, until a <tool_call> tag begins:
    from there the answer is read whole at its end (parse_answer), and what it adds to the
    content is sent then (rest). Held back meanwhile: a piece that may be the start of a tag,
    and trailing whitespace (parse_answer drops it before a call). Each delta costs its own
    length: a run of whitespace tokens (a model stuck on newlines, or pushed there by
    logit_bias) is held as a list, never scanned again (it held the event loop for minutes)."""

    def __init__(self) -> None:
        self._sent: list[str] = []
        self._ws: list[str] = []   # whitespace held back: sent when text follows it
        self._tail = ""            # held back: may be the start of a tag (shorter than one)
        self.tagged = False

    def feed(self, delta: str) -> str:
        if self.tagged or not delta:
            return ""
        new = self._tail + delta   # a tag cannot begin in held whitespace or in text sent
        at = new.find(_TAG)
        if at >= 0:
            self.tagged = True
            body, self._tail = new[:at], ""
        else:
            k = next((k for k in range(min(len(_TAG) - 1, len(new)), 0, -1) if new.endswith(_TAG[:k])), 0)
            body, self._tail = new[:len(new) - k], new[len(new) - k:]
        text = body.rstrip()
        if not text:
            if body:
                self._ws.append(body)
            return ""
        out = "".join(self._ws) + text
        self._ws = [body[len(text):]] if len(body) > len(text) else []
        self._sent.append(out)
        return out

    def rest(self, content: str | None) -> str:
        """What is left to send of the whole answer's content (parse_answer's)."""
        sent = "".join(self._sent)
        content = content or ""
        if not content.startswith(sent):   # not expected: parse_answer keeps the text before the first tag
            log.error("an auto tool answer's streamed text is not the start of its content; the rest is not sent")
            return ""
        return content[len(sent):]


# an enforced call's name: compact JSON (grammar.py), name before arguments (llguidance keeps
# the schema's order, call_schema's), after '[' or '},' in an array of calls; the name is known
# once its closing quote comes (a name holds no quote), and its arguments follow _ARGS_KEY
_CALL_HEAD = re.compile(r'(?:\[|\},)?\{"name":"([A-Za-z0-9_-]{1,64})"')
_ARGS_KEY = ',"arguments":'


class CallStream:
    """The tool_calls deltas of an enforced answer (tool_choice required or a named function)
    as its text is generated, the way OpenAI streams them: a call's first delta carries its
    index, id, type and name (arguments ""), the next ones pieces of its arguments' JSON text.
    The grammar holds the text to call_schema, so a call is known as soon as its name is
    closed. An answer cut short by max_tokens leaves its last call's arguments unfinished
    (or empty, cut before they began); parse_answer reads a cut answer with it too."""

    def __init__(self) -> None:
        self.text = ""
        self.pos = 0               # scanned up to here
        self.calls = 0             # calls started
        self.in_key = False        # a call named, its ',"arguments":' not all generated yet
        self.in_args = False
        self.depth = 0             # nesting inside the current arguments value
        self.in_str = self.esc = False

    def feed(self, delta: str) -> list[dict]:
        self.text += delta
        out: list[dict] = []
        while True:
            if self.in_key:
                if not self.text.startswith(_ARGS_KEY, self.pos):   # not all generated yet
                    return out
                self.pos, self.in_key, self.in_args, self.depth = self.pos + len(_ARGS_KEY), False, True, 0
            if not self.in_args:
                m = _CALL_HEAD.match(self.text, self.pos)
                if m is None:
                    return out
                out.append({"index": self.calls, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                            "function": {"name": m.group(1), "arguments": ""}})
                self.calls += 1
                self.pos, self.in_key = m.end(), True
                continue
            start, end = self.pos, self._scan()
            if end > start:
                out.append({"index": self.calls - 1, "function": {"arguments": self.text[start:end]}})
            self.pos = end
            if self.in_args:      # the arguments go on in text not generated yet
                return out

    def _scan(self) -> int:
        """Past the current arguments' text generated so far; ends in_args at its last character."""
        i = self.pos
        while i < len(self.text):
            ch = self.text[i]
            i += 1
            if self.in_str:
                if self.esc:
                    self.esc = False
                elif ch == "\\":
                    self.esc = True
                elif ch == '"':
                    self.in_str = False
            elif ch == '"':
                self.in_str = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth < 0:    # a scalar's arguments, ended by its call's '}'
                    self.in_args, self.depth = False, 0
                    return i - 1
            if self.depth == 0 and not self.in_str:   # a closed object (or a scalar's last character)
                if ch in "}]" or ch == '"':
                    self.in_args = False
                    return i
        return i
