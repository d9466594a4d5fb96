"""`python -m entrypoints.openai.serve`: the OpenAI-compatible server for one model.

Every EngineConfig field is a flag of the same name (generated from the dataclass, so a new knob
appears here by itself; its help is the field's comment), plus the server's own flags. Example:

    python -m entrypoints.openai.serve --model=default --port=8000 --max_num_seqs=16 --api_key=secret

Only `main` reads FLAGS. `main` takes an optional engine factory so a test can serve another engine
through the same flag handling; by default it builds the real LLMEngine.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import re
import types
import typing

from absl import app, flags

from engine.config import EngineConfig
from engine.sampling_params import MAX_N
from entrypoints.openai.api_server import ServerConfig, run_server
from entrypoints.openai.protocol import MAX_PROMPTS

FLAGS = flags.FLAGS

flags.DEFINE_string("host", "127.0.0.1", "Address to listen on (0.0.0.0 for every interface).")
flags.DEFINE_integer("port", 8000, "Port to listen on; 0 picks a free one (printed at start-up).")
flags.DEFINE_string("api_key", None, "If set, /v1 requests need 'Authorization: Bearer <api_key>'.")
flags.DEFINE_string("served_model_name", None, "Model name in the API; default: the engine's model name.")
flags.DEFINE_integer("max_queue_len", None, "Most waiting sequences (prompts x n); beyond it new requests get "
                     "503 with Retry-After, and a request larger than it gets 400. Default: unbounded.",
                     lower_bound=1)
flags.DEFINE_integer("max_n", MAX_N, "Most samples (n) per prompt.", lower_bound=1, upper_bound=MAX_N)
flags.DEFINE_integer("max_prompts", MAX_PROMPTS, "Most prompts in one /v1/completions request.", lower_bound=1,
                     upper_bound=MAX_PROMPTS)
flags.DEFINE_integer("max_body_bytes", None, "Request body limit in bytes (413 beyond). Default: 1 MiB + 64 bytes "
                     "per token of max_model_len.", lower_bound=1)
flags.DEFINE_float("header_timeout_s", 10.0, "Seconds a client has to send a request's line and headers; "
                   "slower connections are dropped (counted in /metrics). 0: no limit.", lower_bound=0.0)
flags.DEFINE_float("body_timeout_s", 30.0, "Seconds a client has to send a request body once its headers "
                   "arrived; slower ones get 408 and are dropped (counted in /metrics). 0: no limit.",
                   lower_bound=0.0)
flags.DEFINE_float("keepalive_timeout_s", 15.0, "Seconds an idle keep-alive connection stays open.",
                   lower_bound=0.0)
flags.DEFINE_integer("num_prepare_threads", 2, "Worker threads that parse bodies, render chat templates and "
                     "tokenize, off the event loop.", lower_bound=1, upper_bound=64)
flags.DEFINE_bool("trust_chat_special_tokens", False, "Let chat message content spell control tokens (e.g. "
                  "<|im_start|>) that become real ones: only for trusted clients; by default such text stays "
                  "plain text.")
flags.DEFINE_float("shutdown_grace_s", 30.0, "After SIGTERM, seconds in-flight requests may take to finish.",
                   lower_bound=0.0)
flags.DEFINE_enum("log_level", "info", ["debug", "info", "warning", "error"], "Python logging level.")


def _field_comments() -> dict[str, str]:
    """EngineConfig field name -> the comment at the end of its line in config.py."""
    comments = {}
    for line in inspect.getsource(EngineConfig).splitlines():
        match = re.match(r"\s+(\w+):[^#]*#\s*(.+)$", line)
        if match:
            comments[match.group(1)] = match.group(2).strip()
    return comments


def _optional(hint) -> tuple[object, bool]:
    """(the type inside `X | None`, whether None is allowed)."""
    args = typing.get_args(hint)
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        inner = [a for a in args if a is not type(None)]
        return inner[0], len(inner) < len(args)
    return hint, False


def define_engine_flags() -> list[str]:
    """Defines one flag per EngineConfig field; returns the field names."""
    hints = typing.get_type_hints(EngineConfig)
    comments = _field_comments()
    names = []
    for field in dataclasses.fields(EngineConfig):
        hint, nullable = _optional(hints[field.name])
        default = field.default
        help_text = f"EngineConfig.{field.name}: {comments.get(field.name, field.name)}"
        if nullable:
            help_text += " (an empty value means None)"
        if hint is bool:
            flags.DEFINE_bool(field.name, default, help_text)
        elif hint is int:
            flags.DEFINE_integer(field.name, default, help_text)
        elif hint is float:
            flags.DEFINE_float(field.name, default, help_text)
        elif typing.get_origin(hint) is tuple:
            flags.DEFINE_list(field.name, None if default is None else [str(v) for v in default], help_text)
        else:
            flags.DEFINE_string(field.name, default, help_text)
        names.append(field.name)
    return names


ENGINE_FLAGS = define_engine_flags()


def engine_config_from_flags() -> EngineConfig:
    hints = typing.get_type_hints(EngineConfig)
    values = {}
    for name in ENGINE_FLAGS:
        value = FLAGS[name].value
        hint, nullable = _optional(hints[name])
        if nullable and value in ("", []):
            value = None
        elif name == "speculative_config" and value is not None:
            try:
                value = json.loads(value)
            except ValueError:
                raise app.UsageError(f"--{name} must be a JSON object, e.g. "
                                     '\'{"method": "ngram", "num_speculative_tokens": 3}\'') from None
        elif name == "lora_modules" and value is not None:
            value = tuple(value)  # "name=path" strings (checked by EngineConfig)
        elif typing.get_origin(hint) is tuple and value is not None:
            try:
                value = tuple(int(v) for v in value)
            except ValueError:
                raise app.UsageError(f"--{name} must be a comma-separated list of integers") from None
        values[name] = value
    try:
        return EngineConfig.from_kwargs(**values)
    except ValueError as exc:
        raise app.UsageError(str(exc)) from None


def server_config_from_flags() -> ServerConfig:
    return ServerConfig(
        host=FLAGS.host,
        port=FLAGS.port,
        api_key=FLAGS.api_key or None,
        served_model_name=FLAGS.served_model_name or None,
        max_queue_len=FLAGS.max_queue_len,
        max_n=FLAGS.max_n,
        max_prompts=FLAGS.max_prompts,
        max_body_bytes=FLAGS.max_body_bytes,
        header_timeout_s=FLAGS.header_timeout_s,
        body_timeout_s=FLAGS.body_timeout_s,
        keepalive_timeout_s=FLAGS.keepalive_timeout_s,
        num_prepare_threads=FLAGS.num_prepare_threads,
        trust_chat_special_tokens=FLAGS.trust_chat_special_tokens,
        shutdown_grace_s=FLAGS.shutdown_grace_s,
    )


def _build_llm_engine(config: EngineConfig):
    # Imported here so that jax and the model load only when serving the real engine.
    from engine.scaleout.dp_engine import make_engine

    return make_engine(config)


def main(argv, engine_factory=None) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    logging.getLogger().setLevel(FLAGS.log_level.upper())
    config = engine_config_from_flags()
    server_config = server_config_from_flags()
    engine = (engine_factory or _build_llm_engine)(config)
    run_server(engine, server_config)


if __name__ == "__main__":
    app.run(main)
