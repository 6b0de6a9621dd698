"""One JSON schema built from several: a call's arguments (each tool's parameters), an
answer's format.

Each part's local definitions (`$defs`, `definitions`) move to the combined schema's root
`$defs` under the part's own prefix, and its local `$ref`s follow them; a ref to the part's
root or into its body points at a copy of the body kept there. So the combined schema reads
as a root with `$defs`, the only form in which closed_schema.py can tell which definitions
are used where closing them is unsafe (left nested at `/anyOf/0/$defs`, a guarded definition
was closed and an answer that its schema allows was refused), and refs resolve from the root
as llguidance resolves them.
"""
from __future__ import annotations

from typing import Any

# keywords whose value is data (a "$ref" in it is text), and whose value is a map of
# name -> subschema (a property called "examples" is a name there, not the keyword)
_DATA = frozenset({"const", "enum", "default", "examples"})
_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
# meaningless below the root (a nested $id would move refs' base); x-guidance, llguidance's
# options, is the server's to set (schema_leniency.held_as drops a client's)
_ROOT_ONLY = ("$schema", "$id", "x-guidance")


class SchemaParts:
    def __init__(self) -> None:
        self.defs: dict[str, Any] = {}

    def add(self, schema: Any, prefix: str) -> Any:
        """The part's body, to place anywhere in the combined schema; its definitions are kept
        here. `prefix` must be unique per part and hold no '/' or '~'."""
        if not isinstance(schema, dict):
            return schema   # true, false: nothing to move
        moved = _Moved(prefix)
        body = moved.schema({k: v for k, v in schema.items() if k not in ("$defs", "definitions", *_ROOT_ONLY)})
        for key, tag in (("$defs", "."), ("definitions", ":")):
            defs = schema.get(key)
            if isinstance(defs, dict):
                for name, sub in defs.items():
                    self.defs[prefix + tag + name] = moved.schema(sub)
        if moved.root_used:
            self.defs[prefix] = body
        return body

    def root(self, schema: dict) -> dict:
        """`schema` (built from the parts' bodies) with their definitions at its root."""
        return {**schema, "$defs": self.defs} if self.defs else schema


class _Moved:
    def __init__(self, prefix: str):
        self.prefix = prefix
        self.root_used = False

    def ref(self, ref: str) -> str:
        for key, tag in (("$defs", "."), ("definitions", ":")):
            head = f"#/{key}/"
            if ref.startswith(head):   # the escaped name: the prefix has nothing to escape
                return f"#/$defs/{self.prefix}{tag}{ref[len(head):]}"
        self.root_used = True
        return f"#/$defs/{self.prefix}{ref[1:]}"

    def schema(self, node: Any) -> Any:
        if isinstance(node, list):
            return [self.schema(x) for x in node]
        if not isinstance(node, dict):
            return node
        out: dict[str, Any] = {}
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
                out[key] = self.ref(value)
            elif key in _DATA:
                out[key] = value
            elif key in _MAPS and isinstance(value, dict):
                out[key] = {name: self.schema(sub) for name, sub in value.items()}
            else:
                out[key] = self.schema(value)
        return out
