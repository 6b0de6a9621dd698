"""Objects hold only the properties their schema names, unless it says otherwise.

JSON Schema lets an object carry keys its `properties` do not name unless the schema says
`"additionalProperties": false`. Most schemas clients send leave it out: LangChain's and
pydantic's schemas from Python functions and models, tool parameters written by hand. Held
to such a schema a small model writes the declared keys and then invents more until
max_tokens runs out (measured with SmolLM2: a required `get_weather(city, unit)` call went on
with `"properties":{"temperature":...}` for 200 tokens, so the client got no call at all).

So before a schema is compiled, every object that names its properties and says nothing
about others is closed, and an array that lists `prefixItems` without `items` takes no more
items (xgrammar's strict mode, the default where vLLM and SGLang use it, reads schemas the
same way). Closing only narrows: every output valid under the closed schema is valid under
the client's. To keep that true, nothing is closed where narrowing could widen or empty the
result: under `not`, `if`/`then`/`else` and dependent schemas, in an object that also has
`$ref`, `allOf`, `anyOf` or `oneOf` beside its properties, in a member of an `allOf` with more
than one member, or in a `$defs` entry such a member refers to. A schema that wants open
objects says `"additionalProperties": true` (or gives a schema for the extra values).
"""
from __future__ import annotations

import json
from typing import Any

# keywords whose value is one subschema, a list of them, or a map of name -> subschema
_ONE = ("items", "additionalProperties", "unevaluatedItems", "contains", "propertyNames")
_LIST = ("prefixItems", "anyOf", "oneOf", "items")
_MAP = ("properties", "patternProperties", "$defs", "definitions")
# never walked: not, if/then/else, dependentSchemas (narrowing there could widen the result,
# or send an instance down another branch), and the members of an allOf of two or more
_COMPOSED = ("$ref", "allOf", "anyOf", "oneOf")
_OPEN_KEYS = ("additionalProperties", "unevaluatedProperties", "patternProperties")


def close_objects(schema_json: str) -> str:
    """The schema (compact JSON text) with its open objects and arrays closed, as above."""
    try:
        root = json.loads(schema_json)
    except (ValueError, RecursionError):
        return schema_json   # llguidance names what is wrong with it
    if not isinstance(root, dict):
        return schema_json
    skip_defs = _refs_under_intersections(root)
    stack: list[tuple[Any, bool]] = [(root, "#" not in skip_defs)]   # (schema, may it be closed)
    while stack:
        node, closable = stack.pop()
        if not isinstance(node, dict):
            continue
        composed = any(k in node for k in _COMPOSED)
        if closable and not composed:
            if isinstance(node.get("properties"), dict) and not any(k in node for k in _OPEN_KEYS):
                node["additionalProperties"] = False
            if isinstance(node.get("prefixItems"), list) and "items" not in node and "unevaluatedItems" not in node:
                node["items"] = False
        if composed and "properties" in node:
            continue   # its properties meet the branches' or the target's: closing could empty them
        for key in _ONE:
            if isinstance(node.get(key), dict):
                stack.append((node[key], True))
        for key in _LIST:
            if isinstance(node.get(key), list):
                stack.extend((s, True) for s in node[key])
        for key in _MAP:
            sub = node.get(key)
            if isinstance(sub, dict):
                top_defs = node is root and key in ("$defs", "definitions")
                stack.extend((s, not (top_defs and f"#/{key}/{name}" in skip_defs)) for name, s in sub.items())
        members = node.get("allOf")
        if isinstance(members, list) and len(members) == 1:
            stack.append((members[0], True))   # one member is the member itself
        # _NEVER and the members of a real intersection are left as the client wrote them
    return json.dumps(root, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def _refs_under_intersections(root: dict) -> set[str]:
    """Every $ref found under an allOf of two or more members, and every $ref found in the
    definitions those point to, and so on."""
    refs: set[str] = set()
    todo: list[tuple[Any, bool]] = [(root, False)]
    while todo:
        node, inside = todo.pop()
        if isinstance(node, dict):
            ref = node.get("$ref")
            if inside and isinstance(ref, str) and ref not in refs:
                refs.add(ref)
                target = _local_def(root, ref)
                if target is not None:
                    todo.append((target, True))
            members = node.get("allOf")
            for k, v in node.items():
                todo.append((v, inside or (k == "allOf" and isinstance(members, list) and len(members) > 1)))
        elif isinstance(node, list):
            todo.extend((v, inside) for v in node)
    return refs


def _local_def(root: dict, ref: str) -> Any:
    """What `#/$defs/name` or `#/definitions/name` points to in root, else None."""
    for key in ("$defs", "definitions"):
        prefix = f"#/{key}/"
        if ref.startswith(prefix) and isinstance(root.get(key), dict):
            return root[key].get(ref[len(prefix):])
    return None
