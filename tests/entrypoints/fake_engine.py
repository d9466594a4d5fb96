"""A fake LLMEngine for server tests: the real interface, a hand-computable model, no jax.

- Tokenizer: one token per character (id = code point + 3); 0 pad, 1 BOS, 2 EOS. The chat template
  writes `<|role|>content\n` per message and ends with `<|assistant|>`.
- Model: over the 27 characters a..z and space, the candidate k (k = 0..26) of the next token is
  character (v + k) % 27 with probability proportional to 2**-k, where v = (31 * sum(ids) + 7 *
  len(ids)) % 27 over the prompt and the sample's tokens so far. Greedy takes k = 0; sampling draws
  k from a generator seeded by (seed, sample index, position), so a seed fixes the output.
- Scheduler: FCFS, at most max_num_seqs running, one token per running sample per step, KV blocks
  of block_size tokens out of num_kv_blocks (minus the null block), preemption of the newest
  running request when blocks run out. Aborts and finishes free blocks, so KV usage returns to 0.
  max_num_seqs counts requests, but the waiting count in the stats is in sequences (samples), as
  the real engine's scheduler counts them.
- Stop strings end a sample (excluded from the text); text that could be the start of a stop
  string is held back until it cannot be, like the real engine.
- A prompt containing "FAIL_STEP" makes the next step raise, to test error isolation; one
  containing "KILL_ENGINE" makes it raise and mark the engine dead (`dead_reason`), like a runner
  that lost its device state.
- Token ids: the vocabulary is every code point (`vocab_size`); ids of surrogates decode to U+FFFD.
"""

from __future__ import annotations

import dataclasses
import math
import random
import time

from engine.config import EngineConfig
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from engine.sampling_params import SamplingParams

OFFSET = 3
ALPHABET = "abcdefghijklmnopqrstuvwxyz "
_LOG_Z = math.log(sum(2.0**-k for k in range(len(ALPHABET))))


@dataclasses.dataclass
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_compilations: int = 0
    num_free_blocks: int = 0
    num_cached_blocks: int = 0


class FakeTokenizer:
    pad_token_id = 0
    bos_token_id = 1
    eos_token_id = 2
    vocab_size = 0x110000 + OFFSET

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [ord(c) + OFFSET for c in text]
        return [self.bos_token_id, *ids] if add_special_tokens else ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join("\ufffd" if 0xD800 <= i - OFFSET < 0xE000 else chr(i - OFFSET) for i in ids if i >= OFFSET)

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> str:
        parts = []
        for message in messages:
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise ValueError("messages: each message needs a string role")
            if not isinstance(message.get("content"), str):
                raise ValueError("messages: each message needs string content")
            parts.append(f"<|{message['role']}|>{message['content']}\n")
        if add_generation_prompt:
            parts.append("<|assistant|>")
        return "".join(parts)


def candidate_logprobs(ids: list[int]) -> list[tuple[int, float]]:
    """(token id, logprob) of every candidate next token, most likely first."""
    v = (31 * sum(ids) + 7 * len(ids)) % len(ALPHABET)
    return [
        (ord(ALPHABET[(v + k) % len(ALPHABET)]) + OFFSET, -k * math.log(2.0) - _LOG_Z)
        for k in range(len(ALPHABET))
    ]


@dataclasses.dataclass
class _Sample:
    index: int
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[dict[int, float]] = dataclasses.field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: str | None = None


@dataclasses.dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    samples: list[_Sample]
    num_blocks: int = 0

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)


class FakeLLMEngine:
    def __init__(self, config: EngineConfig, *, step_sleep: float = 0.0):
        self.config = config
        self.tokenizer = FakeTokenizer()
        self.max_model_len = config.max_model_len or 512
        self.model_name = "fake-model"
        self.step_sleep = step_sleep
        self.num_kv_blocks = (config.num_kv_blocks or 1024) - 1  # block 0 is the null block
        self._requests: dict[str, _Request] = {}
        self._waiting: list[str] = []
        self._running: list[str] = []
        self._stats = EngineStats(num_compilations=3)
        self.dead_reason: str | None = None
        self.group_ids: dict[str, str | None] = {}  # request id -> the group_id it came with

    # ---- interface ----

    def add_request(self, request_id, prompt, params: SamplingParams, arrival_time=None, group_id=None) -> None:
        if self.dead_reason is not None:
            raise RuntimeError(f"the engine is dead: {self.dead_reason}")
        if request_id in self._requests:
            raise ValueError(f"request_id: duplicate request id {request_id!r}")
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
            if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.tokenizer.vocab_size for t in ids):
                raise ValueError("prompt: token ids must be integers in the vocabulary")
        if not ids:
            raise ValueError("prompt: the prompt is empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt: {len(ids)} tokens leave no room to generate (max_model_len={self.max_model_len})")
        metrics = RequestMetrics(arrival_time=arrival_time if arrival_time is not None else time.monotonic())
        samples = [_Sample(index=i) for i in range(params.n)]
        text = prompt if isinstance(prompt, str) else None
        self._requests[request_id] = _Request(request_id, text, ids, params, metrics, samples)
        self._waiting.append(request_id)
        self.group_ids[request_id] = group_id

    def abort_request(self, request_id: str) -> bool:
        request = self._requests.pop(request_id, None)
        if request is None:
            return False
        for queue in (self._waiting, self._running):
            if request_id in queue:
                queue.remove(request_id)
        request.num_blocks = 0
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self._waiting or self._running)

    def get_stats(self) -> EngineStats:
        used = sum(r.num_blocks for r in self._requests.values())
        return dataclasses.replace(
            self._stats,
            num_running=len(self._running),
            num_waiting=sum(len(self._requests[r].samples) for r in self._waiting),  # in sequences
            kv_cache_usage=used / self.num_kv_blocks,
            num_free_blocks=self.num_kv_blocks - used,
        )

    def step(self) -> list[RequestOutput]:
        if self.step_sleep:
            time.sleep(self.step_sleep)
        if self.dead_reason is not None:
            raise RuntimeError(f"the engine is dead: {self.dead_reason}")
        prompts = [self.tokenizer.decode(self._requests[r].prompt_token_ids) for r in self._running + self._waiting]
        if any("KILL_ENGINE" in p for p in prompts):
            self.dead_reason = "injected device loss"
            raise RuntimeError("injected device loss")
        if any("FAIL_STEP" in p for p in prompts):
            raise RuntimeError("injected step failure")
        self._admit()
        outputs = []
        for request_id in list(self._running):
            request = self._requests[request_id]
            if not self._grow(request):
                continue
            now = time.monotonic()
            for sample in request.samples:
                if sample.finish_reason is None:
                    self._generate_one(request, sample)
            request.metrics.last_token_time = now
            if request.metrics.first_token_time is None:
                request.metrics.first_token_time = now
            if request.finished:
                request.metrics.finished_time = now
                self._running.remove(request_id)
                del self._requests[request_id]
            outputs.append(self._output(request))
        return outputs

    # ---- internals ----

    def _blocks_needed(self, request: _Request) -> int:
        longest = max(len(s.token_ids) for s in request.samples) + 1
        per_sample = -(-(len(request.prompt_token_ids) + longest) // self.config.block_size)
        return per_sample * len(request.samples)

    def _free_blocks(self) -> int:
        return self.num_kv_blocks - sum(r.num_blocks for r in self._requests.values())

    def _admit(self) -> None:
        while self._waiting and len(self._running) < self.config.max_num_seqs:
            request = self._requests[self._waiting[0]]
            if self._blocks_needed(request) > self._free_blocks():
                break
            self._waiting.pop(0)
            self._running.append(request.request_id)
            request.num_blocks = self._blocks_needed(request)
            self._stats.num_prompt_tokens += len(request.prompt_token_ids)
            self._stats.prefix_cache_queries += len(request.prompt_token_ids)

    def _grow(self, request: _Request) -> bool:
        """Makes room for this step's token, preempting the newest other running request."""
        while self._blocks_needed(request) - request.num_blocks > self._free_blocks():
            victim_id = self._running[-1]
            victim = self._requests[victim_id]
            self._running.remove(victim_id)
            self._waiting.insert(0, victim_id)
            victim.num_blocks = 0
            self._stats.num_preemptions += 1
            if victim is request:
                return False
        request.num_blocks = self._blocks_needed(request)
        return True

    def _generate_one(self, request: _Request, sample: _Sample) -> None:
        params = request.params
        candidates = candidate_logprobs(request.prompt_token_ids + sample.token_ids)
        if params.greedy:
            k = 0
        else:
            seed = params.seed if params.seed is not None else hash(request.request_id)
            rng = random.Random(f"{seed}-{sample.index}-{len(sample.token_ids)}")
            k = rng.choices(range(len(candidates)), weights=[2.0**-i for i in range(len(candidates))])[0]
        token, logprob = candidates[k]
        sample.token_ids.append(token)
        if params.logprobs is not None:
            top = dict(candidates[: params.logprobs])
            top[token] = logprob
            sample.logprobs.append(top)
        self._stats.num_generation_tokens += 1
        full_text = self.tokenizer.decode(sample.token_ids)
        for stop in params.stop:
            at = full_text.find(stop)
            if at >= 0:
                sample.text = full_text[: at + len(stop)] if params.include_stop_str_in_output else full_text[:at]
                sample.finish_reason, sample.stop_reason = "stop", stop
                return
        total = len(request.prompt_token_ids) + len(sample.token_ids)
        if (params.max_tokens is not None and len(sample.token_ids) >= params.max_tokens) or total >= self.max_model_len:
            sample.finish_reason = "length"
            sample.text = full_text
            return
        hold = max((len(s) - 1 for s in params.stop), default=0)
        sample.text = full_text[: len(full_text) - hold] if hold else full_text

    def _output(self, request: _Request) -> RequestOutput:
        completions = [
            CompletionOutput(
                index=s.index,
                text=s.text,
                token_ids=list(s.token_ids),
                finish_reason=s.finish_reason,
                stop_reason=s.stop_reason,
                logprobs=[dict(d) for d in s.logprobs] if request.params.logprobs is not None else None,
            )
            for s in request.samples
        ]
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=list(request.prompt_token_ids),
            outputs=completions,
            finished=request.finished,
            metrics=dataclasses.replace(request.metrics),
        )
