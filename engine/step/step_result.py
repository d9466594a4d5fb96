"""The step's packed result (sampler.py: one float32 row per logit row, [id, logprob, top ids,
top logprobs]) read on the host into a StepResult, and the draft head's hidden rows."""

from __future__ import annotations

import numpy as np

from scheduler import SchedulerOutput, StepResult, TokenLogprobs


def _logprobs_at(host: np.ndarray, j: int, k: int) -> TokenLogprobs:
    return TokenLogprobs(float(host[j, 1]), host[j, 2 : 2 + k].astype(np.int64).tolist(), host[j, 2 + k :].tolist())


def read_result(out: SchedulerOutput, host: np.ndarray, row_num_logits, sampling, num_kept, *,
                num_logprobs: int, verifies: bool, wants_logprobs) -> StepResult:
    """The StepResult; num_kept[row] is set to the tokens each row keeps (the rng steps).
    verifies: the bucket's rows may carry drafts (speculative decoding); wants_logprobs[row]: the
    row's request asked for logprobs."""
    k = num_logprobs
    ids = host[:, 0].astype(np.int64).tolist()
    req_ids, tokens, logprobs = [], [], []
    rejected = [] if verifies else None
    any_logprobs = bool(wants_logprobs[sampling].any())
    prompt_logprobs = None
    i = 0
    for row, sr in enumerate(out.scheduled):
        n = int(row_num_logits[row])
        if not n:
            continue
        p = sr.num_prompt_logits
        if p:  # prompt scoring: rows i .. i + p - 1 hold the prompt tokens' logprobs
            if prompt_logprobs is None:
                prompt_logprobs = {}
            prompt_logprobs[sr.req_id] = (sr.num_computed_tokens + 1, [_logprobs_at(host, j, k) for j in range(i, i + p)])
            i, n = i + p, n - p
            num_kept[row] = n
            if not n:
                continue
        req_ids.append(sr.req_id)
        kept = n
        if n > 1 and rejected is not None:
            # Verify drafts: keep samples while they equal the drafts, then the first that
            # differs. (Without speculation a row's several logit rows are all kept.)
            drafts = sr.token_ids[len(sr.token_ids) - n + 1 :]
            kept = 1
            while kept < n and ids[i + kept - 1] == drafts[kept - 1]:
                kept += 1
            num_kept[row] = kept
        tokens.append(ids[i : i + kept])
        if rejected is not None:
            rejected.append(n - kept)
        if any_logprobs:
            logprobs.append([_logprobs_at(host, j, k) for j in range(i, i + kept)] if wants_logprobs[row] else None)
        i += n
    return StepResult(req_ids, tokens, logprobs if any_logprobs else None, rejected, prompt_logprobs)


def hidden_rows(out: SchedulerOutput, row_num_logits, result: StepResult) -> dict[str, int]:
    """Each sampling request's hidden row: its block of logit rows ends at its last draft; the
    row of its last kept token is that minus the drafts it rejected."""
    rejected = dict(zip(result.req_ids, result.num_rejected_tokens or [0] * len(result.req_ids)))
    rows, offset = {}, 0
    for row, sr in enumerate(out.scheduled):
        n = int(row_num_logits[row])
        if n and sr.req_id in rejected:
            rows[sr.req_id] = offset + n - 1 - rejected[sr.req_id]
        offset += n
    return rows
