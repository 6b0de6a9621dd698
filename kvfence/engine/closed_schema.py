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
result: under `not`, `if`/`then`/`else`, dependent schemas and `oneOf` (closed members could
turn an instance that matched two of them into one that matches one), in a schema that
has two or more of `properties`, `$ref`, `allOf`, `anyOf` and `oneOf` side by side, in the members of an
`allOf` of two or more, nor in any `$defs` entry referred to from those places (the nested
inheritance pattern, `{"allOf": [{"$ref": Base}], "properties": {...}}`, was emptied by a
closed Base before review caught it). The one `oneOf` that is closed is a discriminated
union, pydantic's tagged union (`Field(discriminator=...)`): no instance can match two of
its members, so it means `anyOf` (see _discriminated); left open, the model wrote extra keys
in the chosen member until max_tokens. A schema that wants open objects says
`"additionalProperties": true` (or gives a schema for the extra values).
"""
from __future__ import annotations

import json
from typing import Any

# keywords whose value is one subschema, a list of them, or a map of name -> subschema: walked
_ONE = ("items", "additionalProperties", "unevaluatedItems", "contains", "propertyNames")
_LIST = ("prefixItems", "anyOf", "items")
_MAP = ("properties", "patternProperties", "$defs", "definitions")
# never walked, nor the definitions they refer to: narrowing under not, if/then/else or
# dependent schemas could widen the result or send an instance down another branch; closing
# oneOf members could make an instance that matched two of them (invalid) match one (valid),
# unless the oneOf is a discriminated union (_discriminated)
_GUARDED = ("not", "if", "then", "else", "dependentSchemas", "dependencies", "oneOf")
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
    guarded = _guarded_refs(root)
    if "#" in guarded:
        return schema_json   # the whole schema is used where narrowing is not safe
    stack: list[dict] = [root]
    while stack:
        node = stack.pop()
        if _intersection(node):
            continue   # its parts meet (properties, the target's, the branches'): closing could empty them
        if not any(k in node for k in _COMPOSED):
            if isinstance(node.get("properties"), dict) and not any(k in node for k in _OPEN_KEYS):
                node["additionalProperties"] = False
            if isinstance(node.get("prefixItems"), list) and "items" not in node and "unevaluatedItems" not in node:
                node["items"] = False
        for key in _ONE:
            if isinstance(node.get(key), dict):
                stack.append(node[key])
        for key in _LIST:
            if isinstance(node.get(key), list):
                stack.extend(s for s in node[key] if isinstance(s, dict))
        for key in _MAP:
            sub = node.get(key)
            if isinstance(sub, dict):
                defs = node is root and key in ("$defs", "definitions")
                stack.extend(s for name, s in sub.items()
                             if isinstance(s, dict) and not (defs and f"#/{key}/{name}" in guarded))
        members = node.get("allOf")
        if isinstance(members, list) and len(members) == 1 and isinstance(members[0], dict):
            stack.append(members[0])   # one member is the member itself
        if _discriminated(root, node):
            stack.extend(s for s in node["oneOf"] if isinstance(s, dict))   # as anyOf: see _discriminated
        # _GUARDED and the members of a real intersection are left as the client wrote them
    return json.dumps(root, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def _guarded_refs(root: dict) -> set[str]:
    """Every $ref found where closing is not safe (under _GUARDED keywords, under an allOf of
    two or more members, anywhere inside an object that has properties beside $ref, allOf,
    anyOf or oneOf), and every $ref in the definitions those point to, and so on."""
    refs: set[str] = set()
    todo: list[tuple[Any, bool]] = [(root, False)]
    while todo:
        node, inside = todo.pop()
        if isinstance(node, dict):
            ref = node.get("$ref")
            if inside and isinstance(ref, str) and ref not in refs:
                refs.add(ref)
                target = root if ref == "#" else _local_def(root, ref)
                if target is not None:
                    todo.append((target, True))
            members = node.get("allOf")
            mixed = _intersection(node)
            union = _discriminated(root, node)
            for k, v in node.items():
                guard = (mixed or (k in _GUARDED and not (k == "oneOf" and union)) or
                         (k == "allOf" and isinstance(members, list) and len(members) > 1))
                todo.append((v, inside or guard))
        elif isinstance(node, list):
            todo.extend((v, inside) for v in node)
    return refs


def _intersection(node: dict) -> bool:
    """Two or more of properties, $ref, allOf, anyOf and oneOf side by side: an instance must
    meet each, so closing each could leave nothing that meets all. `{"$ref": A, "anyOf": [...]}`
    had its branches and A closed, and refused an instance with A's keys and a branch's."""
    return sum(k in node for k in ("properties", *_COMPOSED)) >= 2


def _local_def(root: dict, ref: str) -> Any:
    """What `#/$defs/name` or `#/definitions/name` points to in root, else None."""
    for key in ("$defs", "definitions"):
        prefix = f"#/{key}/"
        if ref.startswith(prefix) and isinstance(root.get(key), dict):
            return root[key].get(ref[len(prefix):])
    return None


def _discriminated(root: dict, node: dict) -> bool:
    """Whether node's oneOf is a discriminated union that may be closed like an anyOf: every
    member (or the local definition its $ref names) is `"type": "object"`, requires one same
    property and pins it to its own constant (`const`, or `enum` of one value, as pydantic
    writes `Literal` tags), and node has no $ref, allOf, anyOf or properties beside it.

    Sound: a member accepts only objects whose tag is its constant (its other keywords can
    only add constraints), so no instance matches two members and oneOf means anyOf. Closing
    a member only removes instances from it, so the members stay exclusive and each accepts
    a subset of what it did: whatever the closed union accepts, the client's accepted. With
    a sibling beside the oneOf, closing both could empty their intersection; with the tag
    optional in a member, or constants that JSON calls equal (1, 1.0), two members could
    share an instance, and closing one could make that instance valid. Those stay open."""
    members = node.get("oneOf")
    if not isinstance(members, list) or not members or any(k in node for k in ("$ref", "allOf", "anyOf", "properties")):
        return False
    shapes = []
    for m in members:
        if isinstance(m, dict) and "$ref" in m:
            m = _local_def(root, m["$ref"]) if isinstance(m["$ref"], str) else None
        if not (isinstance(m, dict) and m.get("type") == "object"
                and isinstance(m.get("properties"), dict) and isinstance(m.get("required"), list)):
            return False   # `required` and `properties` say nothing of a string or an array
        shapes.append(m)
    for name in shapes[0]["required"]:
        tags = [t[0] for t in (_tag(s, name) for s in shapes) if t is not None]
        if len(tags) == len(shapes) and all(a != b for i, a in enumerate(tags) for b in tags[i + 1:]):
            return True
    return False


def _tag(member: dict, name: Any) -> tuple[Any] | None:
    """(value,) where member requires `name` and pins it to one scalar value, else None.
    Python's == is never stricter than JSON's equality on scalars (1 == 1.0, and True == 1 only
    makes two tags look equal), so tags it calls different are different."""
    prop = member["properties"].get(name) if isinstance(name, str) else None
    if name not in member["required"] or not isinstance(prop, dict):
        return None
    if "const" in prop:
        value = prop["const"]
    elif isinstance(prop.get("enum"), list) and len(prop["enum"]) == 1:
        value = prop["enum"][0]
    else:
        return None
    return (value,) if value is None or isinstance(value, (str, int, float)) else None
