"""jaxserve's text layer: tokenizers, incremental detokenization and chat templates (no jax).

- `tokenizer`: the `Tokenizer` class and `load_tokenizer` (GGUF, Hugging Face folder, bare files).
- `tokenizer_spec`: the `TokenizerSpec` record a loader hands to `Tokenizer`.
- `tokenizer_gguf`, `tokenizer_hf`: the loaders, from a GGUF vocabulary and from Hugging Face files.
- `tokenizer_snapshot`: a tokenizer saved beside converted weights (orbax checkpoints).
- `byte_tokenizer`: the byte-level tokenizer of random-weight models.
- `detokenizer`: `IncrementalDetokenizer`, text deltas for streamed tokens.
- `chat_template`: the checkpoint's Jinja chat template, rendered as transformers does.
"""
