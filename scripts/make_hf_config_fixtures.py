"""Tiny random Hugging Face models in both config formats, with transformers' logits (dev-only).

transformers 5 writes RoPE as `rope_parameters` (no top-level `rope_theta`); transformers 4 wrote
`rope_theta` / `rope_scaling`. The config reader must give the same model from either, and the
model must compute what transformers computes. For each tiny model below this writes
`tests/fixtures/hf_tiny/<name>/`:

- with transformers 5 and torch (the default): `config.json` and `model.safetensors` by
  `save_pretrained` (float32, random weights, norms and biases randomized too), a small
  `tokenizer.json` (a word-level vocabulary, so the folder serves as a user would have it), and in
  `tests/fixtures/hf_tiny/reference.npz` transformers' float32 logits at every position of each
  prompt (`<name>/logits_<i>`) and a greedy continuation (`<name>/greedy_<i>`, each step
  re-running the whole sequence, eager attention); `reference.json` has the prompts, the
  versions and the command.
- with `--configs_only` under transformers 4 (no torch needed): `config_v4.json`, the same model's
  config as transformers 4 saves it.

    .venv-ref/bin/python scripts/make_hf_config_fixtures.py                   # transformers 5.24
    /tmp/venv-t4/bin/python scripts/make_hf_config_fixtures.py --configs_only # transformers 4.57
"""

import argparse
import datetime
import json
import pathlib
import platform
import shlex
import sys

import numpy as np
import transformers

ROOT = pathlib.Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "fixtures" / "hf_tiny"
VOCAB = 64
# head_dim 16 with hidden 32 and 4 heads: head_dim is not hidden / heads (8).
SHAPE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
             rms_norm_eps=1e-5, initializer_range=0.1, bos_token_id=1, eos_token_id=2)
MODELS = {
    "llama_theta5e5": ("LlamaConfig", dict(rope_theta=5e5, tie_word_embeddings=False)),
    "llama3_scaling": ("LlamaConfig", dict(
        rope_theta=5e5, tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "llama_linear": ("LlamaConfig", dict(rope_theta=1e4, rope_scaling={"rope_type": "linear", "factor": 4.0})),
    "mistral_window": ("MistralConfig", dict(rope_theta=1e6, sliding_window=5)),
    "qwen2_bias": ("Qwen2Config", dict(rope_theta=1e6, tie_word_embeddings=True)),
}
PROMPTS = [[1, 5, 9, 33, 12, 7, 40], [1, 17, 3, 60, 22, 8, 8, 45, 31, 10, 11, 50],
           [1] + [(7 * i + 3) % (VOCAB - 3) + 3 for i in range(19)]]
NUM_GREEDY = 8


def make_config(name: str):
    cls, extra = MODELS[name]
    return getattr(transformers, cls)(**SHAPE, **extra)


def write_tokenizer(folder: pathlib.Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
         "tokenizer_class": "PreTrainedTokenizerFast"}, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs_only", action="store_true",
                        help="write config_v4.json only (run under transformers 4)")
    args = parser.parse_args()
    if args.configs_only:
        for name in MODELS:
            folder = OUT / name
            folder.mkdir(parents=True, exist_ok=True)
            text = make_config(name).to_json_string(use_diff=True)
            (folder / "config_v4.json").write_text(text)
        print(f"wrote config_v4.json for {len(MODELS)} models (transformers {transformers.__version__})")
        return
    import torch

    torch.manual_seed(0)
    arrays, greedy = {}, {}
    for name in MODELS:
        folder = OUT / name
        folder.mkdir(parents=True, exist_ok=True)
        config = make_config(name)
        config._attn_implementation = "eager"
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if "norm" in pname:
                    p.copy_(1 + 0.2 * torch.randn_like(p))
                elif pname.endswith("bias"):
                    p.copy_(0.2 * torch.randn_like(p))
        model.save_pretrained(folder)
        write_tokenizer(folder)
        greedy[name] = []
        for i, prompt in enumerate(PROMPTS):
            with torch.no_grad():
                ids = torch.tensor([prompt])
                arrays[f"{name}/logits_{i}"] = model(ids).logits[0].numpy().astype(np.float32)
                for _ in range(NUM_GREEDY):
                    nxt = model(ids).logits[0, -1].argmax()
                    ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
            greedy[name].append(ids[0, len(prompt):].tolist())
    np.savez_compressed(OUT / "reference.npz", **arrays)
    meta = {
        "prompts": PROMPTS, "greedy": greedy, "models": {n: MODELS[n][0] for n in MODELS},
        "versions": {"transformers": transformers.__version__, "torch": torch.__version__,
                     "python": platform.python_version()},
        "command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
        "date": datetime.date.today().isoformat(),
    }
    (OUT / "reference.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(f"wrote {len(MODELS)} models and their reference to {OUT}")


if __name__ == "__main__":
    main()
