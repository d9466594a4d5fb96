"""Llama 2/3, Mistral, Qwen2 (and SmolLM2, a Llama): RMSNorm, RoPE, GQA, SwiGLU."""

from models.families.base import Family

FAMILIES = {
    "llama": Family("llama", ("LlamaForCausalLM",), max_position_embeddings=2048, rms_norm_eps=1e-6),
    "mistral": Family("mistral", ("MistralForCausalLM",), max_position_embeddings=131072,
                      rms_norm_eps=1e-6, sliding_window=4096),
    "qwen2": Family("qwen2", ("Qwen2ForCausalLM",), max_position_embeddings=32768, rms_norm_eps=1e-6,
                    qkv_bias=True),
}
