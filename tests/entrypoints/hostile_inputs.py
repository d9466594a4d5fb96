"""Hostile request bodies, shared by the fake-engine matrix and the random:tiny end-to-end check.

`CASES` is a list of (name, path, raw body bytes). None of them may get a 5xx, and after each a
normal greedy request must return the same text as before. Imported by tests (this folder is on
sys.path), not collected itself.
"""

import json

COMP = "/v1/completions"
CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]

_BIG_INTS = {"2**31": 2**31, "2**32": 2**32, "2**63": 2**63, "2**64": 2**64, "2**70": 2**70, "-2**63-1": -(2**63) - 1}


def _dump(body) -> bytes:
    return json.dumps(body, allow_nan=True).encode()


def _nested(depth: int, leaf: str = "1") -> str:
    return "[" * depth + leaf + "]" * depth


def _cases() -> list[tuple[str, str, bytes]]:
    cases: list[tuple[str, str, bytes]] = []
    add = lambda name, path, body: cases.append((name, path, body if isinstance(body, bytes) else _dump(body)))

    # Overflowing integers in every numeric field (completions and chat).
    comp_fields = ("max_tokens", "n", "top_k", "seed", "logprobs", "best_of")
    for field in comp_fields:
        for label in ("2**31", "2**64", "2**70", "-2**63-1"):
            add(f"{field}={label}", COMP, {"prompt": "a", "max_tokens": 4, field: _BIG_INTS[label]}
                if field != "max_tokens" else {"prompt": "a", field: _BIG_INTS[label]})
    for field in ("max_completion_tokens", "top_logprobs", "n", "top_k", "seed"):
        extra = {"logprobs": True} if field == "top_logprobs" else {}
        add(f"chat {field}=2**63", CHAT, {"messages": MSG, "max_tokens": 4, field: 2**63, **extra})
    add("stop_token_ids=[2**31]", COMP, {"prompt": "a", "stop_token_ids": [2**31]})
    add("stop_token_ids=[2**70]", COMP, {"prompt": "a", "stop_token_ids": [2**70]})
    add("prompt ids [2**31]", COMP, {"prompt": [2**31], "max_tokens": 4})
    add("prompt ids [2**64]", COMP, {"prompt": [5, 2**64], "max_tokens": 4})
    add("prompt ids [-1]", COMP, {"prompt": [[5], [-1]], "max_tokens": 4})
    add("5000-digit integer", COMP, b'{"prompt": "a", "max_tokens": ' + b"9" * 5000 + b"}")
    add("float 1e308 top_k", COMP, {"prompt": "a", "top_k": 1e308})
    add("max_tokens 1e300", COMP, {"prompt": "a", "max_tokens": 1e300})
    # NaN and infinities.
    for field in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        add(f"{field}=NaN", COMP, {"prompt": "a", field: float("nan")})
    add("temperature=Infinity", COMP, {"prompt": "a", "temperature": float("inf")})
    add("top_p=-Infinity", COMP, {"prompt": "a", "top_p": float("-inf")})
    add("n=Infinity", COMP, {"prompt": "a", "n": float("inf")})
    add("min_p=1e400", COMP, b'{"prompt": "a", "min_p": 1e400}')
    # Wrong types.
    for field, value in (("n", "3"), ("max_tokens", []), ("temperature", {}), ("stream", 1), ("stop", 5),
                         ("stop", [[]]), ("echo", "yes"), ("seed", 1.5), ("top_k", True), ("logprobs", "2"),
                         ("stream_options", []), ("stop_token_ids", "1,2"), ("ignore_eos", 0)):
        add(f"{field}={value!r}", COMP, {"prompt": "a", "max_tokens": 4, field: value})
    add("prompt object", COMP, {"prompt": {"text": "a"}})
    add("prompt [None]", COMP, {"prompt": [None]})
    add("prompt [1.5]", COMP, {"prompt": [1.5]})
    add("messages object", CHAT, {"messages": {"role": "user", "content": "x"}})
    add("message role list", CHAT, {"messages": [{"role": ["user"], "content": "x"}]})
    add("message content number", CHAT, {"messages": [{"role": "user", "content": 7}]})
    add("message name number", CHAT, {"messages": [{"role": "user", "content": "x", "name": 3}]})
    # Huge n, stop lists, logprobs, prompt lists.
    add("n=10**6", COMP, {"prompt": "a", "n": 10**6})
    add("n=17", COMP, {"prompt": "a", "n": 17})
    add("stop x 10000", COMP, {"prompt": "a", "stop": ["x"] * 10000})
    add("stop string 100 KB", COMP, {"prompt": "a", "stop": ["y" * 100_000]})
    add("logprobs=10**6", COMP, {"prompt": "a", "logprobs": 10**6})
    add("top_logprobs=10**9", CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 10**9})
    add("100000 prompts", COMP, {"prompt": ["a"] * 100_000})
    add("stop_token_ids x 100000", COMP, {"prompt": "a", "stop_token_ids": list(range(100_000))})
    add("prompt of 200000 ids", COMP, {"prompt": [5] * 200_000})
    add("64 prompts x n=16 over the queue", COMP, {"prompt": ["a"] * 64, "n": 16, "max_tokens": 4})
    # Invalid UTF-8 and lone surrogates.
    add("invalid UTF-8", COMP, b'{"prompt": "\xff\xfe\xfd", "max_tokens": 4}')
    add("truncated UTF-8", COMP, b'{"prompt": "caf\xc3", "max_tokens": 4}')
    add("lone surrogate prompt", COMP, b'{"prompt": "a\\ud800b", "max_tokens": 4}')
    add("lone low surrogate prompt list", COMP, b'{"prompt": ["ok", "\\udfff"], "max_tokens": 4}')
    add("lone surrogate chat content", CHAT, b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}')
    add("lone surrogate content part", CHAT,
        b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud83d"}]}]}')
    add("lone surrogate stop", COMP, b'{"prompt": "a", "stop": ["\\ud800"], "max_tokens": 4}')
    add("lone surrogate model", COMP, b'{"prompt": "a", "model": "\\ud800"}')
    add("lone surrogate role", CHAT, b'{"messages": [{"role": "\\ud800", "content": "x"}]}')
    # Out-of-vocabulary token ids, with and without echo.
    add("oov ids", COMP, {"prompt": [0x7FFFFFFF], "max_tokens": 4})
    add("oov ids with echo", COMP, {"prompt": [0x7FFFFFFF], "max_tokens": 4, "echo": True})
    add("oov ids in a batch with echo", COMP, {"prompt": [[5, 6], [0x10FFFF + 10]], "max_tokens": 4, "echo": True})
    add("echo with logprobs", COMP, {"prompt": "abc", "max_tokens": 4, "echo": True, "logprobs": 2})
    # Deep nesting.
    add("nested array 100000", COMP, _nested(100_000).encode())
    add("nested prompt 50000", COMP, b'{"prompt": ' + _nested(50_000).encode() + b"}")
    add("nested object 50000", COMP, b'{"a":' * 50_000 + b"1" + b"}" * 50_000)
    add("nested content", CHAT, b'{"messages": [{"role": "user", "content": ' + _nested(20_000, '"x"').encode() + b"}]}")
    add("nested unknown field", COMP, b'{"prompt": "a", "user": ' + _nested(30_000).encode() + b"}")
    # Bodies that are not requests.
    for raw in (b"", b"null", b"123", b'"text"', b"[]", b"{", b'{"prompt": "a",}', b"\x00\x01\x02", b"NaN"):
        add(f"body {raw[:12]!r}", COMP, raw)
    add("chat body null", CHAT, b"null")
    return cases


CASES = _cases()
