"""What a request's logit_bias, allowed_token_ids and bad_words become in the runner.

All three fold into one logit-bias row per request (request_table.py, written once when the
request joins, added in the sampler when some row of the step uses one):
- allowed_token_ids: -inf everywhere, 0 at the allowed ids;
- logit_bias: OpenAI's bias added at each id (an id outside allowed_token_ids stays -inf);
- bad_words (vLLM's semantics): each word is tokenized as written and with a leading space; a
  word of one token is -inf for good; for a longer one the last token is banned whenever the
  output ends with the others, which changes every step, so it goes to the host token mask
  (BadWordsState) instead.
Ids outside the sampled vocabulary are a ParamError naming the field.
"""

from __future__ import annotations

import math

from engine.errors import ParamError
from engine.row_params import BiasRow
from engine.sampling_params import SamplingParams


def _check_ids(ids, vocab_size: int, param: str) -> None:
    for t in ids:
        if not 0 <= t < vocab_size:
            raise ParamError(param, f"'{param}' holds the token id {t}, outside the vocabulary [0, {vocab_size})")


def bad_word_sequences(words, tokenizer) -> list[tuple[int, ...]]:
    sequences = []
    for word in words:
        for text in (word, " " + word.lstrip(" ")):
            ids = tuple(tokenizer.encode(text, add_special_tokens=False))
            if ids and ids not in sequences:
                sequences.append(ids)
    return sequences


def build_logit_controls(params: SamplingParams, tokenizer, vocab_size: int):
    """(BiasRow or None, the multi-token bad-word sequences) for one request."""
    if params.logit_bias is None and params.allowed_token_ids is None and params.bad_words is None:
        return None, []
    values: dict[int, float] = {}
    base = 0.0
    if params.allowed_token_ids is not None:
        _check_ids(params.allowed_token_ids, vocab_size, "allowed_token_ids")
        base = -math.inf
        values = dict.fromkeys(params.allowed_token_ids, 0.0)
    for token_id, bias in params.logit_bias or ():
        _check_ids((token_id,), vocab_size, "logit_bias")
        if base == 0.0 or token_id in values:
            values[token_id] = values.get(token_id, 0.0) + bias
    multi = []
    for seq in bad_word_sequences(params.bad_words or (), tokenizer):
        seq = tuple(t for t in seq if t < vocab_size)
        if len(seq) == 1:
            values[seq[0]] = -math.inf
        elif seq:
            multi.append(seq)
    if base == 0.0 and not values:
        return None, multi
    ids = tuple(sorted(values))
    return BiasRow(base, ids, tuple(values[i] for i in ids)), multi
