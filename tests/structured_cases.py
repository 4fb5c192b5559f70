"""JSON schemas the structured-output tests run: nested objects, arrays, enums, required fields, string
patterns, numbers in ranges. Every string and array is bounded, so that even a random model (which never
chooses to close a string) finishes within MAX_TOKENS."""

from __future__ import annotations

MAX_TOKENS = 160
NAME = {"type": "string", "minLength": 1, "maxLength": 12}
AGE = {"type": "integer", "minimum": 0, "maximum": 120}

SCHEMAS: dict[str, dict] = {
    "flat object": {"type": "object", "properties": {"name": NAME, "age": AGE}, "required": ["name", "age"]},
    "enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    "boolean and null": {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "none": {"type": "null"}},
        "required": ["ok", "none"],
    },
    "nested object": {
        "type": "object",
        "properties": {
            "person": {
                "type": "object",
                "properties": {
                    "name": NAME,
                    "address": {
                        "type": "object",
                        "properties": {"city": NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                        "required": ["city", "zip"],
                    },
                },
                "required": ["name", "address"],
            }
        },
        "required": ["person"],
    },
    "array of integers": {"type": "array", "items": AGE, "minItems": 1, "maxItems": 4},
    "array of objects": {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {"id": AGE, "tag": {"enum": ["a", "b"]}},
                    "required": ["id", "tag"],
                },
            }
        },
        "required": ["items"],
    },
    "string pattern": {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
        "required": ["code"],
    },
    "date-like pattern": {
        "type": "object",
        "properties": {"day": {"type": "string", "pattern": "^20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])$"}},
        "required": ["day"],
    },
    "number range": {
        "type": "object",
        "properties": {"score": {"type": "integer", "minimum": -5, "maximum": 5}},
        "required": ["score"],
    },
    "optional field": {
        "type": "object",
        "properties": {"a": AGE, "b": NAME},
        "required": ["a"],
        "additionalProperties": False,
    },
    "const": {"type": "object", "properties": {"kind": {"const": "point"}, "x": AGE}, "required": ["kind", "x"]},
    "anyOf": {"type": "object", "properties": {"v": {"anyOf": [AGE, {"enum": ["none"]}]}}, "required": ["v"]},
    "array of enums": {"type": "array", "items": {"enum": ["x", "y", "z"]}, "minItems": 2, "maxItems": 3},
    "deep nesting": {
        "type": "object",
        "properties": {
            "a": {
                "type": "object",
                "properties": {
                    "b": {
                        "type": "object",
                        "properties": {"c": {"type": "object", "properties": {"d": AGE}, "required": ["d"]}},
                        "required": ["c"],
                    }
                },
                "required": ["b"],
            }
        },
        "required": ["a"],
    },
    "tuple-like array": {"type": "array", "prefixItems": [NAME, AGE], "items": False, "minItems": 2},
    "string enum with spaces": {
        "type": "object",
        "properties": {"answer": {"enum": ["yes please", "no thanks"]}},
        "required": ["answer"],
    },
    "email-ish pattern": {
        "type": "object",
        "properties": {"email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"}},
        "required": ["email"],
    },
    "two required strings": {
        "type": "object",
        "properties": {"first": NAME, "last": NAME},
        "required": ["first", "last"],
    },
    "matrix": {"type": "array", "maxItems": 2, "items": {"type": "array", "maxItems": 2, "items": AGE}},
    "mixed": {
        "type": "object",
        "properties": {
            "id": AGE,
            "tags": {"type": "array", "items": {"enum": ["p", "q"]}, "maxItems": 2},
            "meta": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
        },
        "required": ["id", "tags", "meta"],
    },
}
ARITHMETIC_EBNF = """root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= [0-9] [0-9]? | "(" expr ")"
"""
