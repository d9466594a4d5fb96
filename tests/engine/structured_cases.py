"""Random JSON schemas for the structured-output acceptance (nested objects, arrays, enums,
bounded numbers, required fields), small enough that a 135M model at temperature 1 completes
each within a few dozen tokens: strings and arrays are bounded, no extra properties."""

import random

WORDS = ["red", "green", "blue", "cat", "dog", "yes", "no", "low", "high", "alpha", "beta"]
KEYS = ["name", "age", "color", "size", "kind", "score", "tags", "ok", "level", "id", "note", "info"]


def _leaf(rng: random.Random) -> dict:
    kind = rng.choice(["string", "integer", "number", "boolean", "enum", "array"])
    if kind == "string":
        return {"type": "string", "minLength": rng.randint(0, 2), "maxLength": rng.randint(3, 6)}
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 200)}
    if kind == "number":
        low = rng.randint(-10, 10)
        return {"type": "number", "minimum": low, "maximum": low + rng.randint(1, 100)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(WORDS, rng.randint(2, 4))}
    item = rng.choice([{"type": "integer", "minimum": 0, "maximum": 9}, {"enum": rng.sample(WORDS, 3)}])
    low = rng.randint(0, 1)
    return {"type": "array", "items": item, "minItems": low, "maxItems": low + rng.randint(1, 2)}


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    keys = rng.sample(KEYS, rng.randint(1, 3 - depth))
    properties = {k: (random_schema(rng, depth + 1) if depth == 0 and rng.random() < 0.3 else _leaf(rng))
                  for k in keys}
    required = [k for k in keys if rng.random() < 0.7] or keys[:1]
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


def random_schemas(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [random_schema(rng) for _ in range(n)]
