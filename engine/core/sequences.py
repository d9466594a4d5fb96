"""A request's sequences: the n samples of one prompt, each a scheduler Request ("<id>#<i>" when
n > 1) with its own sampling row (RowParams: seed, penalties, logit bias, grammar and bad-words
state, LoRA adapter) and its SequenceState (request_state.py). LLMEngine.prepare_request validates
the request, then builds them here."""

from __future__ import annotations

import zlib

from engine.core.request_state import RequestState, SequenceState
from engine.row_params import RowParams
from engine.structured_output.masks import BadWordsState
from scheduler import Request


def add_sequences(state: RequestState, max_tokens: int, arrival: float, *, base_seed: int, priority: int,
                  group_id: str, grammar, bias, bad_sequences, adapter, resumed: bool, tokenizer,
                  sample_vocab_size: int) -> None:
    """Appends the request's params.n sequences to state.seqs. Sample i is seeded from
    (base_seed, i); only the first sample scores the prompt (prompt_logprobs), and none of a
    resumed request does (its prompt ran elsewhere)."""
    params, request_id, ids = state.params, state.request_id, state.prompt_token_ids
    eos_ids = set() if params.ignore_eos else set(tokenizer.eos_token_ids)
    stop_ids = tuple(sorted(set(params.stop_token_ids) | eos_ids))
    # top_k past the vocabulary keeps everything: clamped, so it always fits an int32.
    top_k = min(params.top_k, sample_vocab_size) if params.top_k > 0 else 0
    for i in range(params.n):
        seq_id = request_id if params.n == 1 else f"{request_id}#{i}"
        seed = zlib.crc32(f"{base_seed}/{i}".encode())
        row = RowParams(params.temperature, top_k, params.top_p, params.min_p,
                        params.presence_penalty, params.frequency_penalty,
                        params.repetition_penalty, seed, params.logprobs is not None, bias=bias,
                        grammar=grammar.new_state() if grammar is not None else None,
                        banned=BadWordsState(bad_sequences) if bad_sequences else None,
                        lora=adapter)
        sched_req = Request(seq_id, ids, max_tokens, eos_token_id=None if params.ignore_eos
                            else tokenizer.eos_token_id, stop_token_ids=stop_ids,
                            ignore_eos=params.ignore_eos, priority=priority, arrival_time=arrival,
                            sampling=row, group_id=group_id,
                            prompt_logprobs=params.prompt_logprobs is not None and i == 0 and not resumed,
                            lora_id=adapter.key if adapter is not None else 0)
        state.seqs.append(SequenceState(seq_id, i, state, sched_req, row, tokenizer))
