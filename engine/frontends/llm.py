"""The offline API: `LLM(model=..., **knobs).generate(prompts, sampling_params)`, vLLM's names.

Bad input raises ValueError naming the field before anything is queued, so a failing prompt in a
batch never leaves half the batch running.
"""

from __future__ import annotations

import concurrent.futures
import itertools
from collections.abc import Sequence

from tqdm.auto import tqdm

from engine.config import EngineConfig
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.scaleout.dp_engine import make_engine


class LLM:
    def __init__(self, model: str = "default", *, progress: bool = True, **knobs):
        # An LLMEngine, or a DPEngine (same interface) when data_parallel_size > 1.
        self.engine = make_engine(EngineConfig.from_kwargs(model=model, **knobs), progress=progress)
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request=None) -> list[RequestOutput]:
        """lora_request: one engine.LoRARequest for every prompt, or a list with one (or None)
        per prompt; needs LLM(..., enable_lora=True)."""
        prompts = _normalize_prompts(prompts)
        return self._run([(p, True, None) for p in prompts], sampling_params, use_tqdm, lora_request)

    def chat(self, messages, sampling_params=None, use_tqdm: bool = True,
             add_generation_prompt: bool = True, lora_request=None) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"} dicts) or a list of conversations."""
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages: must be a non-empty list of messages or of conversations")
        conversations = messages if isinstance(messages[0], list) else [messages]
        items = []
        for conv in conversations:
            text = self.tokenizer.apply_chat_template(conv, add_generation_prompt=add_generation_prompt)
            # The template already wrote any BOS it wants, so no special tokens are added again.
            items.append((self.engine.tokenize(text, add_special_tokens=False), False, text))
        return self._run(items, sampling_params, use_tqdm, lora_request)

    def _run(self, items, sampling_params, use_tqdm: bool, lora_request=None) -> list[RequestOutput]:
        if sampling_params is None:
            params = [SamplingParams()] * len(items)
        elif isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(items)
        else:
            params = list(sampling_params)
            if len(params) != len(items):
                raise ValueError(f"sampling_params: {len(params)} given for {len(items)} prompts")
        for p in params:
            if not isinstance(p, SamplingParams):
                raise ValueError(f"sampling_params: expected SamplingParams, got {type(p).__name__}")
        for prompt, add_special, _ in items:  # validate everything before queueing anything
            self.engine.tokenize(prompt, add_special)
        if isinstance(lora_request, list | tuple):
            loras = list(lora_request)
            if len(loras) != len(items):
                raise ValueError(f"lora_request: {len(loras)} given for {len(items)} prompts")
        else:
            loras = [lora_request] * len(items)
        manager = getattr(self.engine, "lora_manager", None)
        if manager is not None:  # load (and check) every adapter before queueing anything
            loras = [None if r is None else manager.resolve(r) for r in loras]
        grammars = self._compile_grammars(params)
        ids = []
        try:
            for (prompt, add_special, text), p, grammar, lora in zip(items, params, grammars, loras):
                rid = f"offline-{next(self._ids)}"
                self.engine.add_request(rid, prompt, p, add_special_tokens=add_special, prompt_text=text,
                                        grammar=grammar, **({"lora_request": lora} if lora is not None else {}))
                ids.append(rid)
        except ValueError:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        results: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="generating", unit="req", disable=not use_tqdm, leave=False) as bar:
            while len(results) < len(ids):
                for out in self.engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        bar.update(1)
        return [results[rid] for rid in ids]


    def _compile_grammars(self, params: list[SamplingParams]) -> list:
        """Every request's structured-output grammar, compiled in parallel (llguidance drops the
        GIL); a bad one raises its ParamError before anything is queued."""
        wanted = [p.structured_outputs for p in params]
        if not any(w is not None for w in wanted):
            return [None] * len(params)
        compile_one = lambda so: None if so is None else self.engine.compile_grammar(so)
        with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
            return list(pool.map(compile_one, wanted))


def _normalize_prompts(prompts) -> list:
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, list | tuple) or not prompts:
        raise ValueError("prompts: must be a string, a list of strings, or a list of token-id lists")
    if all(isinstance(p, int) and not isinstance(p, bool) for p in prompts):
        raise ValueError("prompts: a flat list of ints is ambiguous; pass [[ids...]] for one token-id prompt")
    for p in prompts:
        if not isinstance(p, str | list | tuple):
            raise ValueError(f"prompts: each prompt must be a string or a list of token ids, got {type(p).__name__}")
    return [list(p) if isinstance(p, tuple) else p for p in prompts]
