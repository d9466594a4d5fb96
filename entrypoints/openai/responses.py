"""OpenAI response bodies: completions and chat completions, whole and as stream chunks.

Engine outputs are cumulative; a `ChoiceCursor` per choice remembers how much text and how many
tokens were already sent, so a stream sends only what is new and a whole response is the same
computation done once at the end. Logprobs follow OpenAI's two formats: the legacy completions one
(tokens / token_logprobs / top_logprobs / text_offset) and the chat one (content[{token, logprob,
bytes, top_logprobs}]).
"""

from __future__ import annotations

import dataclasses

from engine.outputs import CompletionOutput

MISSING_LOGPROB = -9999.0  # OpenAI's stand-in when a token's logprob is unknown


@dataclasses.dataclass
class ChoiceCursor:
    """What one choice has already sent."""

    num_chars: int = 0
    num_tokens: int = 0
    text_offset: int = 0  # completions logprobs: characters of token text sent so far
    finished: bool = False


@dataclasses.dataclass
class ChoiceDelta:
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None
    stop_reason: str | int | None


def advance(cursor: ChoiceCursor, completion: CompletionOutput) -> ChoiceDelta | None:
    """What is new in `completion` since the cursor; None when nothing is (and not finishing)."""
    if cursor.finished:
        return None
    text = completion.text[cursor.num_chars:]
    token_ids = completion.token_ids[cursor.num_tokens:]
    logprobs = completion.logprobs[cursor.num_tokens:] if completion.logprobs is not None else None
    finishing = completion.finish_reason is not None
    if not text and not token_ids and not finishing:
        return None
    cursor.num_chars = max(cursor.num_chars, len(completion.text))
    cursor.num_tokens = len(completion.token_ids)
    cursor.finished = finishing
    return ChoiceDelta(text, token_ids, logprobs, completion.finish_reason, completion.stop_reason)


class TokenTexts:
    """Token id -> its text, decoded once (logprobs name every token)."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id])
            self._cache[token_id] = text
        return text


def _top(entry: dict[int, float], num_top: int) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda item: -item[1])[:num_top]


def completion_logprobs(texts: TokenTexts, cursor: ChoiceCursor, delta: ChoiceDelta, num_top: int) -> dict:
    """Legacy completions logprobs for the delta's tokens; advances cursor.text_offset."""
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    for token_id, entry in zip(delta.token_ids, delta.logprobs or [{}] * len(delta.token_ids)):
        token = texts(token_id)
        tokens.append(token)
        token_logprobs.append(entry.get(token_id, MISSING_LOGPROB))
        top_logprobs.append({texts(t): lp for t, lp in _top(entry, num_top)})
        text_offset.append(cursor.text_offset)
        cursor.text_offset += len(token)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": text_offset}


def prompt_completion_logprobs(texts: TokenTexts, prompt_ids: list[int], scored: list, num_top: int) -> dict:
    """The prompt's part of legacy completions logprobs (`echo` with `logprobs`): the first token
    has no logprob (None), text offsets count from the start of the prompt's token texts."""
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    offset = 0
    for token_id, entry in zip(prompt_ids, scored):
        token = texts(token_id)
        tokens.append(token)
        token_logprobs.append(None if entry is None else entry.get(token_id, MISSING_LOGPROB))
        top_logprobs.append(None if entry is None else {texts(t): lp for t, lp in _top(entry, num_top)})
        text_offset.append(offset)
        offset += len(token)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": text_offset}


def join_completion_logprobs(first: dict, second: dict | None) -> dict:
    return first if second is None else {key: first[key] + second[key] for key in first}


def vllm_prompt_logprobs(texts: TokenTexts, prompt_ids: list[int], scored: list, num_top: int) -> list:
    """vLLM's `prompt_logprobs` of a choice: per prompt token None (the first) or {token id:
    {logprob, rank (1-based; None for the prompt's own token when it is not among the top
    num_top), decoded_token}}."""
    out = []
    for token_id, entry in zip(prompt_ids, scored):
        if entry is None:
            out.append(None)
            continue
        ranked = [t for t, _ in _top(entry, len(entry))]
        in_top = token_id in ranked[:num_top]
        out.append({str(t): {"logprob": lp, "rank": ranked.index(t) + 1 if t != token_id or in_top else None,
                             "decoded_token": texts(t)} for t, lp in entry.items()})
    return out


def chat_logprobs(texts: TokenTexts, delta: ChoiceDelta, num_top: int) -> dict:
    content = []
    for token_id, entry in zip(delta.token_ids, delta.logprobs or [{}] * len(delta.token_ids)):
        token = texts(token_id)
        content.append({
            "token": token,
            "logprob": entry.get(token_id, MISSING_LOGPROB),
            "bytes": list(token.encode("utf-8")),
            "top_logprobs": [
                {"token": texts(t), "logprob": lp, "bytes": list(texts(t).encode("utf-8"))}
                for t, lp in _top(entry, num_top)
            ],
        })
    return {"content": content}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def envelope(response_id: str, obj: str, created: int, model: str, choices: list[dict], **extra) -> dict:
    return {"id": response_id, "object": obj, "created": created, "model": model, "choices": choices, **extra}


def completion_choice(index: int, text: str, logprobs: dict | None, delta: ChoiceDelta | None) -> dict:
    return {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": delta.finish_reason if delta else None,
        "stop_reason": delta.stop_reason if delta else None,
    }


def chat_message_choice(index: int, content: str | None, logprobs: dict | None, delta: ChoiceDelta,
                        tool_calls: list[dict] | None = None) -> dict:
    message = {"role": "assistant", "content": content}
    finish_reason = delta.finish_reason
    if tool_calls:
        message["tool_calls"] = tool_calls
        finish_reason = tool_finish_reason(finish_reason)
    return {
        "index": index,
        "message": message,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        "stop_reason": delta.stop_reason,
    }


def tool_finish_reason(finish_reason: str | None) -> str | None:
    """A response that calls tools says so, unless it was cut short (length, abort)."""
    return "tool_calls" if finish_reason == "stop" else finish_reason


def chat_chunk_choice(index: int, delta_body: dict, logprobs: dict | None, finish_reason: str | None) -> dict:
    return {"index": index, "delta": delta_body, "logprobs": logprobs, "finish_reason": finish_reason}
