"""JSON schemas of increasing difficulty for structured-output tests. Every one is bounded (strings have a
maxLength, numbers a range, arrays a maxItems, objects no additional properties) so that a random-weights model,
whose choices only the grammar steers, finishes within a few hundred tokens."""

from __future__ import annotations


def _obj(props: dict, required=None) -> dict:
    return {
        "type": "object",
        "properties": props,
        "required": list(props) if required is None else required,
        "additionalProperties": False,
    }


S = {"type": "string", "maxLength": 8}
I = {"type": "integer", "minimum": -50, "maximum": 500}

SCHEMAS = [
    {"type": "boolean"},
    {"enum": ["red", "green", "blue"]},
    {"type": "integer", "minimum": 0, "maximum": 99},
    {"type": "string", "maxLength": 12},
    _obj({"name": S}),
    _obj({"name": S, "age": I}),
    _obj({"ok": {"type": "boolean"}, "nothing": {"type": "null"}, "const": {"const": "fixed"}}),
    _obj({"colour": {"enum": ["red", "green", "blue"]}, "size": {"enum": [1, 2, 3, None]}}),
    _obj({"tags": {"type": "array", "items": S, "minItems": 1, "maxItems": 3}}),
    _obj({"grid": {"type": "array", "items": {"type": "array", "items": I, "maxItems": 2}, "maxItems": 2}}),
    _obj({"name": S, "nick": S}, required=["name"]),
    _obj({"owner": _obj({"name": S, "id": I})}),
    _obj({"a": _obj({"b": _obj({"c": _obj({"d": {"type": "boolean"}})})})}),
    _obj({"value": {"anyOf": [I, S, {"type": "null"}]}}),
    _obj({"id": {"type": "string", "pattern": "^[a-z]{3}-[0-9]{4}$"}}),
    _obj({"items": {"type": "array", "items": _obj({"sku": I, "qty": I}), "minItems": 2, "maxItems": 3}}),
    _obj({"pair": {"type": "array", "prefixItems": [S, I], "items": False, "minItems": 2}}),
    _obj(
        {
            "shape": {
                "anyOf": [
                    _obj({"kind": {"const": "circle"}, "r": I}),
                    _obj({"kind": {"const": "box"}, "w": I}),
                ]
            }
        }
    ),
    {
        "type": "array",
        "items": _obj({"k": {"enum": ["x", "y"]}, "v": {"type": "boolean"}}),
        "minItems": 1,
        "maxItems": 4,
    },
    _obj(
        {
            "order": _obj(
                {
                    "id": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"},
                    "lines": {
                        "type": "array",
                        "items": _obj({"sku": I, "note": {"anyOf": [S, {"type": "null"}]}}),
                        "minItems": 1,
                        "maxItems": 2,
                    },
                    "status": {"enum": ["new", "paid", "sent"]},
                }
            ),
            "priority": {"type": "integer", "minimum": 1, "maximum": 5},
        }
    ),
]
