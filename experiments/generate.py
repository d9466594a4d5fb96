"""Answer one chat prompt with the default model, greedy, through the offline LLM API.

    python -m experiments.generate --prompt="What is the capital of France?"
"""

from __future__ import annotations

import sys
import time

from absl import app, flags

_PROMPT = flags.DEFINE_string("prompt", "What is the capital of France?", "user message")
_MODEL = flags.DEFINE_string("model", "default", "default, a GGUF file, a HF folder, an orbax folder or random:<name>")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 128, "most tokens to generate")
_SYSTEM = flags.DEFINE_string("system", None, "optional system message")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "0 = greedy")


def main(argv) -> None:
    del argv
    from engine import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(_MODEL.value, max_num_seqs=1, max_num_batched_tokens=256, max_model_len=2048,
              token_buckets=(1, 256), seq_buckets=(1,))
    ready = time.perf_counter()
    messages = [{"role": "user", "content": _PROMPT.value}]
    if _SYSTEM.value:
        messages.insert(0, {"role": "system", "content": _SYSTEM.value})
    params = SamplingParams(temperature=_TEMPERATURE.value, max_tokens=_MAX_TOKENS.value)
    out = llm.chat(messages, params, use_tqdm=False)[0].outputs[0]
    done = time.perf_counter()
    print(out.text)
    print(f"[{len(out.token_ids)} tokens in {done - ready:.2f}s; start-up {ready - start:.1f}s; "
          f"finish_reason={out.finish_reason}]", file=sys.stderr)


if __name__ == "__main__":
    app.run(main)
