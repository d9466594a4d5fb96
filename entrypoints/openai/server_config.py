"""The server's settings: `ServerConfig` (every field is a flag of `serve.py`) and the default
request body limit, which grows with max_model_len so that a full-context prompt always fits.
"""

from __future__ import annotations

import dataclasses

from engine.sampling_params import MAX_N
from entrypoints.openai.protocol import MAX_PROMPTS

# Default body limit: room for a max_model_len prompt at 64 bytes per token (long tokens, JSON
# escapes such as \\uXXXX\\uXXXX) plus 1 MiB for everything else in the body.
BODY_BYTES_PER_TOKEN = 64
BODY_BYTES_BASE = 1024 * 1024


def default_body_limit(max_model_len: int) -> int:
    return BODY_BYTES_BASE + BODY_BYTES_PER_TOKEN * max_model_len


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000  # 0: any free port (printed at start-up)
    api_key: str | None = None  # when set, /v1 routes need "Authorization: Bearer <api_key>"
    served_model_name: str | None = None  # None: the engine's model_name
    max_queue_len: int | None = None  # most waiting sequences (prompts x n) before 503; None: unbounded
    max_n: int = MAX_N  # most samples per prompt
    max_prompts: int = MAX_PROMPTS  # most prompts in one /v1/completions request
    max_body_bytes: int | None = None  # request body limit; None: default_body_limit(max_model_len)
    header_timeout_s: float = 10.0  # a request head (line + headers) must arrive within this
    body_timeout_s: float = 30.0  # a request body must arrive within this once its head has
    keepalive_timeout_s: float = 15.0  # an idle keep-alive connection is closed after this
    num_prepare_threads: int = 2  # threads that parse, render chat templates and tokenize
    trust_chat_special_tokens: bool = False  # chat content may spell control tokens (trusted clients)
    shutdown_grace_s: float = 30.0  # after SIGTERM, how long in-flight requests may take to finish

    def __post_init__(self) -> None:
        for name in ("max_queue_len", "max_body_bytes"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"ServerConfig.{name} must be a positive integer or None, got {value!r}")
        for name, high in (("max_n", MAX_N), ("max_prompts", MAX_PROMPTS), ("num_prepare_threads", 64)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= high:
                raise ValueError(f"ServerConfig.{name} must be an integer in [1, {high}], got {value!r}")
        for name in ("header_timeout_s", "body_timeout_s", "keepalive_timeout_s", "shutdown_grace_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                raise ValueError(f"ServerConfig.{name} must be a number >= 0, got {value!r}")
