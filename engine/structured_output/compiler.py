"""GrammarCompiler: StructuredOutputsParams -> a compiled llguidance grammar, through a small LRU.

Called where the request arrives, never on the step thread: the server's prepare threads, the
offline LLM's pool (llguidance drops the GIL while it builds a grammar). The LRU is keyed by the
grammar (kind, text, whitespace option), so a server answering the same schema again compiles it
once. A grammar that does not compile (a schema that is not JSON, an unknown type, a keyword
llguidance does not implement, a regex or Lark grammar that does not parse) is a ParamError
naming the field, with llguidance's message. `check_grammar_text` does the same validation with no
tokenizer, for engines without a compiler (the server's fake engine in tests).

Each sequence gets its own matcher: `CompiledGrammar.new_state()` deep-copies the template, which
is cheap (microseconds) next to compiling.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import threading
import time

import llguidance

from engine.errors import ParamError
from engine.structured_output.ll_tokenizer import build_ll_tokenizer
from engine.structured_output.masks import GrammarState
from engine.structured_params import StructuredOutputsParams

DEFAULT_CACHE_SIZE = 64


def _json_options(params: StructuredOutputsParams) -> dict:
    if params.disable_any_whitespace:
        return {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
    return {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar for `params` (not yet checked); ParamError if it cannot be built."""
    param = params.error_param
    try:
        if params.kind in ("json", "json_object"):
            schema = params.json if params.kind == "json" else {"type": "object"}
            if isinstance(schema, str):
                schema = json.loads(schema)
            if not isinstance(schema, dict | bool):
                raise ValueError("a JSON schema must be an object")
            return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=_json_options(params))
        if params.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(params.regex)
        if params.kind == "choice":
            return llguidance.grammar_from("choice", list(params.choice))
        return llguidance.grammar_from("grammar", params.grammar)
    except (ValueError, TypeError, RecursionError) as exc:
        raise ParamError(param, f"'{param}' is not a valid {params.kind}: {str(exc)[:500]}") from None


def check_grammar_text(params: StructuredOutputsParams, ll_tokenizer=None) -> str:
    """The grammar text, validated by llguidance; ParamError naming the field otherwise."""
    text = grammar_text(params)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text, ll_tokenizer)
    if is_error:
        param = params.error_param
        what = "JSON schema" if params.kind in ("json", "json_object") else params.kind
        raise ParamError(param, f"'{param}' is not a valid {what} for structured output: "
                         f"{(messages[0] if messages else 'rejected')[:500]}")
    return text


@dataclasses.dataclass
class CompiledGrammar:
    key: tuple
    template: llguidance.LLMatcher  # never advanced; each sequence gets a copy
    compile_seconds: float

    mask_words: int  # int32 words of llguidance's mask rows (ceil(its vocabulary / 32))

    def new_state(self) -> GrammarState:
        return GrammarState(self.template.deep_copy(), self.mask_words)


@dataclasses.dataclass
class CompilerStats:
    num_compiled: int = 0  # grammars built (LRU misses)
    num_cache_hits: int = 0
    compile_seconds: float = 0.0  # total time spent building grammars


class GrammarCompiler:
    """Thread-safe: any thread may call compile(); the LLTokenizer is built on first use."""

    def __init__(self, tokenizer, vocab_size: int, *, cache_size: int = DEFAULT_CACHE_SIZE):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.cache_size = cache_size
        self.stats = CompilerStats()
        self._ll_tokenizer = None
        self._lock = threading.Lock()
        self._cache: collections.OrderedDict[tuple, CompiledGrammar] = collections.OrderedDict()

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = build_ll_tokenizer(self.tokenizer, self.vocab_size)
            return self._ll_tokenizer

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        if not isinstance(params, StructuredOutputsParams):
            raise ParamError("structured_outputs", "structured_outputs must be a StructuredOutputsParams")
        key = params.key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.stats.num_cache_hits += 1
                return hit
        ll = self.ll_tokenizer
        start = time.perf_counter()
        text = check_grammar_text(params, ll)
        matcher = llguidance.LLMatcher(ll, text, log_level=0)
        if matcher.is_error():
            param = params.error_param
            raise ParamError(param, f"'{param}' could not be compiled: {matcher.get_error()[:500]}")
        compiled = CompiledGrammar(key, matcher, time.perf_counter() - start, -(-ll.vocab_size // 32))
        with self._lock:
            self.stats.num_compiled += 1
            self.stats.compile_seconds += compiled.compile_seconds
            self._cache[key] = compiled
            self._cache.move_to_end(key)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled
