"""A tool's `parameters` as a JSON Schema: a shape check at the edge, and the move of a schema into a larger
one (the "required" constraint holds every tool's arguments under one root).

The shape check refuses what no JSON Schema library could read (a `properties` that is a list, an unknown
`type`, a nesting too deep to walk) with the path of the offending part, so the client learns which tool and
which keyword. Whether a grammar library can compile the schema is checked where it is compiled."""

from __future__ import annotations

from stepwire.contract import InvalidRequestError

JSON_TYPES = frozenset({"object", "array", "string", "number", "integer", "boolean", "null"})
# Deeper than any real tool's arguments, shallow enough that walking it cannot exhaust Python's stack.
MAX_DEPTH = 32
MAX_NESTING = 2 * MAX_DEPTH + 8   # objects and lists, keywords included (a schema level is two of them)
_SCHEMA = ("items", "additionalProperties", "additionalItems", "not", "contains", "propertyNames", "if", "then",
           "else", "unevaluatedProperties", "unevaluatedItems")
_SCHEMA_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LIST = ("anyOf", "oneOf", "allOf", "prefixItems")
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")
_NUMBERS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")


def check_parameters(schema, field: str) -> None:
    """A function's arguments are a JSON object: the schema is an object schema (its `type`, when given, is
    "object"), and every part of it has the shape JSON Schema gives that keyword."""
    if not isinstance(schema, dict):
        raise InvalidRequestError(field, "must be a JSON Schema object")
    check_nesting(schema, field)
    if schema.get("type", "object") != "object":
        raise InvalidRequestError(f"{field}.type", f'a function\'s arguments are a JSON object: the type must '
                                                   f'be "object", got {_short(schema.get("type"))}')
    _check(schema, field, 0)


def _check(schema, path: str, depth: int) -> None:
    if isinstance(schema, bool):
        return   # true (anything) and false (nothing) are schemas too
    if not isinstance(schema, dict):
        raise InvalidRequestError(path, f"a schema must be an object or a boolean, got {_short(schema)}")
    if depth > MAX_DEPTH:
        raise InvalidRequestError(path, f"the schema is nested deeper than {MAX_DEPTH} levels")
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind] if kind is not None else []
    if (isinstance(kind, list) and not kind) or any(not isinstance(k, str) or k not in JSON_TYPES for k in kinds):
        raise InvalidRequestError(f"{path}.type", f"must be one of {', '.join(sorted(JSON_TYPES))} (or a list of "
                                                  f"them), got {_short(kind)}")
    for key in _SCHEMA:
        if key in schema:
            if key == "items" and isinstance(schema[key], list):   # the tuple form of older drafts
                for i, sub in enumerate(schema[key]):
                    _check(sub, f"{path}.items[{i}]", depth + 1)
            else:
                _check(schema[key], f"{path}.{key}", depth + 1)
    for key in _SCHEMA_MAP:
        if key in schema:
            if not isinstance(schema[key], dict):
                raise InvalidRequestError(f"{path}.{key}", "must map names to schemas")
            for name, sub in schema[key].items():
                _check(sub, f"{path}.{key}.{name if len(name) <= 40 else name[:40] + '...'}", depth + 1)
    for key in _SCHEMA_LIST:
        if key in schema:
            if not isinstance(schema[key], list) or not schema[key]:
                raise InvalidRequestError(f"{path}.{key}", "must be a non-empty list of schemas")
            for i, sub in enumerate(schema[key]):
                _check(sub, f"{path}.{key}[{i}]", depth + 1)
    _check_values(schema, path)


def _check_values(schema: dict, path: str) -> None:
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise InvalidRequestError(f"{path}.required", "must be a list of property names")
    if "enum" in schema and (not isinstance(schema["enum"], list) or not schema["enum"]):
        raise InvalidRequestError(f"{path}.enum", "must be a non-empty list")
    for key in _COUNTS:
        value = schema.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise InvalidRequestError(f"{path}.{key}", f"must be a non-negative integer, got {_short(value)}")
    for key in _NUMBERS:
        value = schema.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise InvalidRequestError(f"{path}.{key}", f"must be a number, got {_short(value)}")
    for key in ("pattern", "$ref", "format"):
        if key in schema and not isinstance(schema[key], str):
            raise InvalidRequestError(f"{path}.{key}", "must be a string")


def check_nesting(value, field: str) -> None:
    """Counted without recursion: any part (a default, an enum, a call's arguments) nested deeper would break
    the recursive code that later writes it out (json.dumps, the template) with a 500 instead of this 400."""
    if _nesting(value) > MAX_NESTING:
        raise InvalidRequestError(field, f"nested deeper than {MAX_NESTING} levels")


def _nesting(value) -> int:
    deepest, todo = 0, [(value, 1)]
    while todo:
        node, depth = todo.pop()
        deepest = max(deepest, depth)
        if isinstance(node, dict):
            todo.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            todo.extend((v, depth + 1) for v in node)
    return deepest


def _short(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def relocated(parameters: dict, name: str, defs: dict) -> dict:
    """`parameters` made fit to sit inside a larger schema: its definitions move into `defs` (the larger
    schema's $defs) under "<name>.<definition>", and its references follow them. A reference to its own root
    ("#", a recursive schema) points at a copy of it kept in `defs` under the tool's name."""
    root_refs = []

    def ref(target: str) -> str:
        for head in ("#/$defs/", "#/definitions/"):
            if target.startswith(head):
                return f"#/$defs/{name}.{target[len(head):]}"
        if target == "#":
            root_refs.append(target)
            return f"#/$defs/{name}"
        return target   # remote references are left for the compiler to refuse

    def move(node):
        if isinstance(node, dict):
            return {k: ref(v) if k == "$ref" and isinstance(v, str) else move(v) for k, v in node.items()}
        if isinstance(node, list):
            return [move(v) for v in node]
        return node

    for key in ("$defs", "definitions"):
        for def_name, sub in (parameters.get(key) or {}).items():
            defs[f"{name}.{def_name}"] = move(sub)
    body = move({k: v for k, v in parameters.items() if k not in ("$defs", "definitions")})
    if root_refs:
        defs[name] = body
    return body
