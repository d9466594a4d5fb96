"""Tiny random models of the newer families, saved by transformers, with transformers' outputs (dev-only).

For each of Qwen3, Gemma 2, Gemma 3 (text), Mixtral and Qwen3-MoE this writes
`tests/fixtures/hf_family/<name>/`: `config.json` and the weights by `save_pretrained` (float32,
random weights with norms randomized too; Gemma's norms near 0 since it scales by 1 + w), the
Mixtral folder as two safetensors shards with an index (`max_shard_size`), a word-level
`tokenizer.json` and a `tokenizer_config.json` with a chat template; and in
`tests/fixtures/hf_family/reference.npz` transformers' float32 logits at the last position of each
prompt (`<name>/last_<i>`), in `reference.json` the greedy continuation of each prompt (each step
re-running the whole sequence, eager attention), the token ids transformers' tokenizer gives a
chat conversation through the template, the versions and the command.

Shapes are tiny (hidden 64, 2-4 layers, vocabulary 128) and windows short (4 tokens), so the
prompts (7-20 tokens) cross them; Gemma 3 has layers sliding, sliding, global, sliding (a period
of 3 with one layer left over) and a linearly scaled global RoPE.

    .venv-ref/bin/python scripts/make_family_fixtures.py     # transformers 5.24 + torch, ~20 s
"""

import datetime
import json
import pathlib
import platform
import shlex
import sys

import numpy as np
import torch
import transformers

ROOT = pathlib.Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "fixtures" / "hf_family"
VOCAB = 128
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
             rms_norm_eps=1e-6, initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=0)
MODELS = {
    "qwen3": ("Qwen3Config", dict(rope_theta=1e6, tie_word_embeddings=False)),
    "gemma2": ("Gemma2Config", dict(sliding_window=4, query_pre_attn_scalar=24,
                                    attn_logit_softcapping=5.0, final_logit_softcapping=3.0)),
    "gemma3_text": ("Gemma3TextConfig", dict(
        num_hidden_layers=4, sliding_window=4, query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2, rope_theta=1e6,
                                      tie_word_embeddings=False)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
                                         norm_topk_prob=False, tie_word_embeddings=False)),
}
SHARDED = {"mixtral"}  # saved as shards with model.safetensors.index.json
PROMPTS = [[1, 5, 9, 33, 12, 7, 40], [1, 17, 3, 60, 22, 8, 8, 45, 31, 10, 11, 50],
           [1] + [(7 * i + 3) % (VOCAB - 9) + 3 for i in range(19)]]
NUM_GREEDY = 8
SPECIAL = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} "
                 "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
CHAT = [{"role": "system", "content": "w10 w11"}, {"role": "user", "content": "w20 w21 w22"}]


def write_tokenizer(folder: pathlib.Path) -> None:
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(SPECIAL)} | {f"w{i}": i for i in range(len(SPECIAL), VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
         "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHAT_TEMPLATE}, indent=2) + "\n")


def randomize_norms(model, gemma: bool) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_((0.0 if gemma else 1.0) + 0.2 * torch.randn_like(p))


def main() -> None:
    torch.manual_seed(0)
    arrays, greedy = {}, {}
    for name, (cls, extra) in MODELS.items():
        folder = OUT / name
        folder.mkdir(parents=True, exist_ok=True)
        for old in folder.glob("*.safetensors*"):
            old.unlink()
        config = getattr(transformers, cls)(**{**SHAPE, **extra})
        config._attn_implementation = "eager"
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        randomize_norms(model, gemma=name.startswith("gemma"))
        model.save_pretrained(folder, max_shard_size="500KB" if name in SHARDED else "50MB")
        write_tokenizer(folder)
        greedy[name] = []
        for i, prompt in enumerate(PROMPTS):
            with torch.no_grad():
                ids = torch.tensor([prompt])
                arrays[f"{name}/last_{i}"] = model(ids).logits[0, -1].numpy().astype(np.float32)
                for _ in range(NUM_GREEDY):
                    nxt = model(ids).logits[0, -1].argmax()
                    ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
            greedy[name].append(ids[0, len(prompt):].tolist())
        print(name, "saved", sorted(p.name for p in folder.iterdir()))
    tokenizer = transformers.AutoTokenizer.from_pretrained(OUT / "qwen3")
    chat_ids = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    if isinstance(chat_ids, dict) or hasattr(chat_ids, "keys"):
        chat_ids = chat_ids["input_ids"]
    np.savez_compressed(OUT / "reference.npz", **arrays)
    meta = {
        "prompts": PROMPTS, "greedy": greedy, "models": {n: MODELS[n][0] for n in MODELS},
        "chat": {"messages": CHAT, "prompt_token_ids": list(chat_ids)},
        "versions": {"transformers": transformers.__version__, "torch": torch.__version__,
                     "python": platform.python_version()},
        "command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
        "date": datetime.date.today().isoformat(),
    }
    (OUT / "reference.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(f"wrote {len(MODELS)} models and their reference to {OUT}")


if __name__ == "__main__":
    main()
