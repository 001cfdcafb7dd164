"""JSON schemas to measure and test structured output with: generated ones shaped like API payloads, and
SchemaStore's real configuration schemas where a package ships them.

`generated_schemas` builds, from a seed, the kind of schema applications send (`response_format`, tool
arguments): objects named after business records, with bounded strings (some with enum, pattern or format),
bounded integers and numbers, booleans, nullable fields, nested objects and bounded arrays,
`additionalProperties: false`.
Every string and array is bounded so that any output the grammar allows ends within a known number of
tokens: a test can then demand that every output is complete and valid, even from a random model.

`schemastore_schemas` reads the schemas `validate-pyproject-schema-store` ships (SchemaStore's pyproject tool
sections: ruff, mypy, uv, poetry...): large, real, with $ref, patternProperties and the rest. Not a dependency:
`pip install validate-pyproject-schema-store` (or put it on PYTHONPATH) for the benchmark to use it.
"""

from __future__ import annotations

import importlib.resources
import json
import random

RECORDS = ["user", "order", "product", "address", "invoice", "event", "ticket", "review", "payment", "shipment",
           "employee", "booking", "device", "article", "recipe", "flight", "patient", "vehicle", "task", "coupon"]
FIELDS = ["id", "name", "title", "status", "email", "city", "country", "code", "note", "label", "kind", "owner",
          "rating", "count", "price", "active", "verified", "tags", "created", "priority", "level", "score",
          "currency", "phone", "summary", "unit", "color", "size", "quantity", "category"]
ENUMS = [["draft", "open", "closed"], ["low", "medium", "high"], ["EUR", "USD", "GBP"], ["red", "green", "blue"],
         ["S", "M", "L", "XL"], ["yes", "no"]]
PATTERNS = [r"^[A-Z]{2}[0-9]{3}$", r"^[a-z]{2,10}$", r"^[0-9]{4}-[0-9]{2}$", r"^#[0-9a-f]{6}$"]
# Formats whose every value is bounded (email and time are not: a local part, a fraction of a second) and
# whose values llguidance and jsonschema agree on (date is not: llguidance allows the year 0000).
FORMATS = ["uuid"]


def _leaf(rng: random.Random) -> dict:
    kind = rng.choice(["string", "string", "enum", "pattern", "format", "integer", "integer", "boolean",
                       "nullable", "number"])
    if kind == "string":
        return {"type": "string", "minLength": rng.choice([0, 1]), "maxLength": rng.choice([4, 8, 12])}
    if kind == "enum":
        return {"type": "string", "enum": rng.choice(ENUMS)}
    if kind == "pattern":
        return {"type": "string", "pattern": rng.choice(PATTERNS)}
    if kind == "format":
        return {"type": "string", "format": rng.choice(FORMATS)}
    if kind == "integer":
        lo = rng.choice([0, 1, -100])
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.choice([9, 99, 9999])}
    if kind == "number":   # bounded in range and in digits, or a random model could write digits forever
        return {"type": "number", "minimum": 0, "maximum": 1000, "multipleOf": 0.5}
    if kind == "nullable":
        return {"anyOf": [{"type": "string", "maxLength": 6}, {"type": "null"}]}
    return {"type": "boolean"}


def _object(rng: random.Random, depth: int, title: str) -> dict:
    names = rng.sample(FIELDS, rng.randint(2, 5 if depth else 6))
    props = {}
    for name in names:
        roll = rng.random()
        if depth < 1 and roll < 0.15:
            props[name] = _object(rng, depth + 1, name)
        elif roll < 0.3:
            items = _leaf(rng) if depth or rng.random() < 0.7 else _object(rng, depth + 1, name)
            props[name] = {"type": "array", "items": items, "minItems": rng.choice([0, 1]),
                           "maxItems": rng.choice([2, 3])}
        else:
            props[name] = _leaf(rng)
    required = [n for n in names if rng.random() < 0.7] or names[:1]
    return {"title": title, "type": "object", "properties": props, "required": required,
            "additionalProperties": False}


def generated_schemas(n: int, seed: int = 0) -> list[dict]:
    """`n` schemas, the same ones for the same seed."""
    rng = random.Random(seed)
    return [_object(rng, 0, f"{rng.choice(RECORDS)}_{i}") for i in range(n)]


def schemastore_schemas() -> list[dict]:
    """SchemaStore's schemas from `validate_pyproject_schema_store`, or [] where it is not installed."""
    try:
        files = importlib.resources.files("validate_pyproject_schema_store") / "resources"
    except ModuleNotFoundError:
        return []
    out = []
    for f in sorted(files.iterdir(), key=lambda f: f.name):
        if f.name.endswith(".schema.json"):
            out.append(json.loads(f.read_text()))
    return out
