"""Twenty JSON schemas for the structured-output tests: objects, nesting, arrays, enums,
required fields, bounded numbers, patterns, refs, unions. Free strings carry a maxLength so a
random-weight model (which rarely picks a closing quote) still ends inside max_tokens."""

from __future__ import annotations

from typing import Any

S8: dict[str, Any] = {"type": "string", "maxLength": 8}

SCHEMAS: list[dict[str, Any]] = [
    {
        "type": "object",
        "properties": {"name": S8, "age": {"type": "integer", "minimum": 0, "maximum": 130}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {"type": "integer", "minimum": 10, "maximum": 20},
    {"type": "number", "minimum": 0, "maximum": 1},
    {"type": "boolean"},
    {"enum": ["red", "green", "blue"]},
    {
        "type": "array",
        "items": {"type": "integer", "minimum": -5, "maximum": 5},
        "minItems": 1,
        "maxItems": 4,
    },
    {
        "type": "object",
        "properties": {
            "address": {
                "type": "object",
                "properties": {"street": S8, "city": S8, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["street", "city", "zip"],
                "additionalProperties": False,
            }
        },
        "required": ["address"],
        "additionalProperties": False,
    },
    {
        "type": "array",
        "maxItems": 3,
        "items": {
            "type": "object",
            "properties": {
                "id": {"type": "integer", "minimum": 1, "maximum": 100},
                "ok": {"type": "boolean"},
            },
            "required": ["id", "ok"],
            "additionalProperties": False,
        },
    },
    {
        "type": "object",
        "properties": {"title": S8, "note": S8, "stars": {"type": "integer", "minimum": 1, "maximum": 5}},
        "required": ["title"],
        "additionalProperties": False,
    },
    {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
    {
        "type": "object",
        "properties": {"version": {"const": "v1"}, "count": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["version", "count"],
        "additionalProperties": False,
    },
    {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99}, {"type": "string", "maxLength": 5}]},
    {
        "type": "object",
        "properties": {"nick": {"type": ["string", "null"], "maxLength": 6}},
        "required": ["nick"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "a": {
                "type": "object",
                "properties": {
                    "b": {
                        "type": "object",
                        "properties": {"c": {"type": "integer", "minimum": 0, "maximum": 3}},
                        "required": ["c"],
                        "additionalProperties": False,
                    }
                },
                "required": ["b"],
                "additionalProperties": False,
            }
        },
        "required": ["a"],
        "additionalProperties": False,
    },
    {"enum": [1, 2.5, -3, "four", None]},
    {"type": "number", "exclusiveMinimum": -1, "exclusiveMaximum": 1},
    {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": 0, "maximum": 9},
                    "y": {"type": "integer", "minimum": 0, "maximum": 9},
                },
                "required": ["x", "y"],
                "additionalProperties": False,
            }
        },
        "type": "object",
        "properties": {"from": {"$ref": "#/$defs/point"}, "to": {"$ref": "#/$defs/point"}},
        "required": ["from", "to"],
        "additionalProperties": False,
    },
    {
        "type": "array",
        "prefixItems": [
            {"type": "string", "maxLength": 4},
            {"type": "integer", "minimum": 0, "maximum": 9},
            {"type": "boolean"},
        ],
        "items": False,
        "minItems": 3,
    },
    {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
            "level": {"enum": ["low", "high"]},
        },
        "required": ["tags", "level"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "id": {"type": "string", "pattern": "^[a-f0-9]{4}$"},
            "price": {"type": "number", "minimum": 0, "maximum": 1000},
            "qty": {"type": "integer", "minimum": 1, "maximum": 50},
        },
        "required": ["id", "price", "qty"],
        "additionalProperties": False,
    },
]
