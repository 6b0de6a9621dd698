"""What a schema that is not `strict` may hold that the grammar cannot: pydantic writes
`uniqueItems` for a set and a `format` llguidance does not know for SecretStr ("password"),
bytes ("binary"), Path ("path") or an IP network, and such a schema was refused (400) under
instructor's TOOLS mode, LiteLLM and LangChain, which send no `strict`.

`held_as` drops just those two from a schema that is not strict: a `format` JSON Schema reads
as a note unless a validator asserts it, and a set's duplicates are dropped when pydantic reads
the answer. Everything else the grammar compiler cannot hold (`not`, `if`/`then`/`else`,
`dependentSchemas`, `contains`, ...) is still refused, since dropping it could let through an
answer the schema forbids; llguidance's own `lenient` mode would drop those too, silently. A
strict schema keeps everything, and the compiler refuses what it cannot hold, as OpenAI's strict
mode refuses what it cannot guarantee.

The client's `x-guidance` (llguidance's options in the schema) is dropped either way: it could
turn off the compact JSON rule or change the separators (grammar.py sets them).
"""
from __future__ import annotations

from typing import Any

# the formats llguidance 1.x enforces; any other is dropped from a schema that is not strict
KNOWN_FORMATS = frozenset({"date-time", "date", "time", "duration", "email", "hostname", "ipv4", "ipv6", "uri",
                           "uuid"})
# keywords whose value is data, not a subschema: never walked into; and keywords whose value
# maps names to subschemas (a property called "uniqueItems" is a name there, not the keyword)
_DATA = frozenset({"const", "enum", "default", "examples", "required", "dependentRequired"})
_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def held_as(schema: dict, strict: bool) -> dict:
    """The schema the grammar is built from (a copy; see the module's text)."""
    out = {k: v for k, v in schema.items() if k != "x-guidance"}
    return out if strict else _lenient(out)


def _lenient(node: Any) -> Any:
    """A subschema (or a list of them) without uniqueItems and unknown formats."""
    if isinstance(node, list):
        return [_lenient(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for k, v in node.items():
        if k == "uniqueItems" or (k == "format" and isinstance(v, str) and v not in KNOWN_FORMATS):
            continue
        if k in _DATA:
            out[k] = v
        elif k in _MAPS and isinstance(v, dict):
            out[k] = {name: _lenient(sub) for name, sub in v.items()}
        else:
            out[k] = _lenient(v)
    return out
