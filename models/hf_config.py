"""Hugging Face `config.json` -> ModelConfig, read strictly.

Both formats transformers writes are understood: transformers 4's top-level `rope_theta` and
`rope_scaling`, and transformers 5's `rope_parameters` (one entry, or one per layer type such as
`{"full_attention": {...}, "sliding_attention": {...}}`). Every field is in one of three groups:

1. Read: the fields that change the computation (shapes, norms, RoPE, activation, biases,
   attention window, tied head). An absent field takes the default of the family's transformers
   config class (`FAMILY_DEFAULTS`), as transformers itself would; a value the engine does not
   implement is a ValueError naming the field and the value.
2. Ignored (`IGNORED_FIELDS`): fields that do not change the forward pass (dropout, initializer
   range, `use_cache`, the saved dtype, token ids, generation defaults, bookkeeping).
3. Anything else is unknown: it is logged as a warning naming it, since a newer transformers may
   write fields that matter; `strict_unknown=True` makes it an error.
"""

from __future__ import annotations

import json
import logging
import os

from models.config import ROPE_SCALING_TYPES, SUPPORTED_ARCHITECTURES, ModelConfig, RopeScaling
from models.families import FAMILIES

log = logging.getLogger(__name__)

# What transformers' config class of each family gives a field that config.json omits (checked
# against transformers 4.57 and 5.24; models/families/ declares them). `qkv_bias`: Qwen2's q/k/v
# projections always have a bias.
FAMILY_DEFAULTS = {
    name: dict(max_position_embeddings=f.max_position_embeddings, rms_norm_eps=f.rms_norm_eps,
               sliding_window=f.sliding_window, qkv_bias=f.qkv_bias, architectures=f.architectures)
    for name, f in FAMILIES.items()
}
# The activations of a SwiGLU MLP (transformers maps "swish" to SiLU too).
SILU = ("silu", "swish")

READ_FIELDS = frozenset({
    "model_type", "architectures", "vocab_size", "hidden_size", "intermediate_size",
    "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters",
    "tie_word_embeddings", "attention_bias", "mlp_bias", "hidden_act", "sliding_window",
    "use_sliding_window", "max_window_layers", "layer_types", "partial_rotary_factor",
    "attn_logit_softcapping", "final_logit_softcapping", "quantization_config", "use_mrope",
    "pretraining_tp",
})
IGNORED_FIELDS = frozenset({
    # Training only, or bookkeeping.
    "attention_dropout", "hidden_dropout", "embd_pdrop", "resid_pdrop", "initializer_range",
    "use_cache", "torch_dtype", "dtype", "transformers_version", "_name_or_path", "auto_map",
    "_attn_implementation", "attn_implementation", "return_dict", "output_hidden_states",
    "output_attentions", "torchscript", "pruned_heads", "chunk_size_feed_forward",
    "is_encoder_decoder", "is_decoder", "cross_attention_hidden_size", "add_cross_attention",
    "tie_encoder_decoder", "finetuning_task", "id2label", "label2id", "task_specific_params",
    "problem_type", "tokenizer_class", "prefix", "tf_legacy_loss", "use_bfloat16",
    "unsloth_version", "num_labels", "cache_implementation",
    # Mixtures of experts: training only (the router's auxiliary loss, its jitter noise, which
    # transformers applies only in training, and returning router logits).
    "router_aux_loss_coef", "router_jitter_noise", "output_router_logits",
    # Token ids: the tokenizer's business (text/), not the forward pass's.
    "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id",
    # Generation defaults (requests carry their own sampling parameters).
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups",
    "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty",
    "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids",
    "num_return_sequences", "output_scores", "return_dict_in_generate", "forced_bos_token_id",
    "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty",
    "suppress_tokens", "begin_suppress_tokens",
})
# Keys a RoPE entry may hold, per rope_type (transformers' names); any other key is refused.
_ROPE_KEYS = {
    "default": {"rope_type", "type", "rope_theta"},
    "linear": {"rope_type", "type", "rope_theta", "factor"},
    "llama3": {"rope_type", "type", "rope_theta", "factor", "low_freq_factor", "high_freq_factor",
               "original_max_position_embeddings"},
}
_LAYER_KINDS = ("full_attention", "sliding_attention")


def _refuse(field: str, value, why: str) -> ValueError:
    return ValueError(f"config.json: {field}={value!r} is not supported: {why}")


def _architecture(config: dict) -> str:
    model_type = config.get("model_type")
    if model_type is None:
        raise ValueError("config.json lacks the field 'model_type' "
                         f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported model_type {model_type!r} in config.json "
                         f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    architectures = config.get("architectures")
    allowed = FAMILY_DEFAULTS[model_type]["architectures"]
    if architectures is not None and any(a not in allowed for a in architectures):
        raise _refuse("architectures", architectures,
                      f"jaxserve serves the causal LM head of {model_type} ({', '.join(allowed)})")
    return model_type


def _layer_kinds(config: dict, model_type: str, num_layers: int) -> tuple[list[str], int | None]:
    """Each layer's attention kind and the one window every sliding layer uses (or None)."""
    defaults = FAMILY_DEFAULTS[model_type]
    window = config.get("sliding_window", defaults["sliding_window"])
    if model_type == "llama" and window is not None:
        raise _refuse("sliding_window", window, "llama attention has no window (transformers "
                      "ignores the field there; say model_type 'mistral' for a windowed model)")
    if model_type in ("qwen2", "qwen3", "qwen3_moe"):
        # Qwen2/3 slide only with use_sliding_window, and then only layers >= max_window_layers.
        if not config.get("use_sliding_window", False):
            window = None
        elif window is not None:
            first = config.get("max_window_layers", 28)
            kinds = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
            if "layer_types" not in config and len(set(kinds)) > 1:
                raise _refuse("use_sliding_window", True,
                              f"with max_window_layers={first} of {num_layers} layers the window "
                              "applies to some layers only; jaxserve applies one kind to all layers")
    elif "use_sliding_window" in config and not config["use_sliding_window"] and window is not None:
        raise _refuse("use_sliding_window", False,
                      f"{model_type} has no switch for its sliding_window={window}")
    default_kind = "full_attention" if window is None else "sliding_attention"
    kinds = config.get("layer_types")
    if not kinds and FAMILIES[model_type].mixed_layers:
        from models.families.gemma import default_layer_types

        kinds = default_layer_types(config, model_type, num_layers)
    kinds = kinds or [default_kind] * num_layers
    if len(kinds) != num_layers or any(k not in _LAYER_KINDS for k in kinds):
        raise _refuse("layer_types", kinds,
                      f"expected {num_layers} entries among {', '.join(_LAYER_KINDS)}")
    if len(set(kinds)) > 1 and FAMILIES[model_type].mixed_layers:
        if window is None:
            raise _refuse("layer_types", "sliding_attention", "no sliding_window is given")
        if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
            raise _refuse("sliding_window", window, "expected a positive integer or null")
        return kinds, window
    if len(set(kinds)) > 1:
        raise _refuse("layer_types", sorted(set(kinds)),
                      "mixed local and global layers are not implemented for "
                      f"{model_type}; every layer must have one attention kind")
    if kinds[0] == "sliding_attention" and window is None:
        raise _refuse("layer_types", "sliding_attention", "no sliding_window is given")
    if kinds[0] == "full_attention":
        window = None
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window <= 0):
        raise _refuse("sliding_window", window, "expected a positive integer or null")
    return kinds, window


def _rope_entry(config: dict, kinds: list[str], kind: str | None = None) -> tuple[dict, str]:
    """The one RoPE entry the model's layers (or those of `kind`) use, and its field."""
    params = config.get("rope_parameters")
    if params is None:
        if kind == "sliding_attention" and "rope_local_base_freq" in config:
            return {"rope_theta": config["rope_local_base_freq"]}, "rope_local_base_freq"
        entry = dict(config.get("rope_scaling") or {})
        if "rope_theta" in config:
            entry.setdefault("rope_theta", config["rope_theta"])
        return entry, "rope_scaling"
    if not isinstance(params, dict):
        raise _refuse("rope_parameters", params, "expected an object")
    if set(params) & set(_LAYER_KINDS) and all(isinstance(v, dict) for v in params.values()):
        # One entry per layer type (transformers 5 writes this for models with several kinds).
        used = sorted(set(kinds)) if kind is None else [kind]
        missing = [k for k in used if k not in params]
        if missing:
            raise _refuse("rope_parameters", sorted(params), f"no entry for layer type {missing[0]}")
        entries = [params[k] for k in used]
        if any(e != entries[0] for e in entries[1:]):
            raise _refuse("rope_parameters", params, "different RoPE per layer type is not implemented")
        params = entries[0]
    entry = dict(params)
    if kind == "sliding_attention" and "rope_local_base_freq" in config:
        entry["rope_theta"] = config["rope_local_base_freq"]
        return entry, "rope_parameters"
    top = config.get("rope_theta")
    if top is not None and "rope_theta" in entry and float(top) != float(entry["rope_theta"]):
        raise ValueError(f"config.json: rope_theta={top!r} and rope_parameters.rope_theta="
                         f"{entry['rope_theta']!r} disagree")
    if top is not None:
        entry.setdefault("rope_theta", top)
    return entry, "rope_parameters"


def _rope(config: dict, kinds: list[str], kind: str | None = None) -> tuple[float, RopeScaling | None]:
    entry, field = _rope_entry(config, kinds, kind)
    rope_type = entry.get("rope_type", entry.get("type", "default"))
    if rope_type not in _ROPE_KEYS:
        raise _refuse(f"{field}.rope_type", rope_type,
                      f"supported: {', '.join(('default',) + ROPE_SCALING_TYPES)}")
    partial = entry.pop("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if float(partial) != 1.0:
        raise _refuse("partial_rotary_factor", partial, "RoPE over part of each head is not implemented")
    extra = sorted(set(entry) - _ROPE_KEYS[rope_type] - {"original_max_position_embeddings"})
    if extra:
        raise _refuse(f"{field}.{extra[0]}", entry[extra[0]], f"not a parameter of rope_type {rope_type!r}")
    theta = float(entry.get("rope_theta", 10000.0))

    def need(key: str):
        if key not in entry:
            raise ValueError(f"config.json: {field} of rope_type {rope_type!r} lacks {key!r}")
        return entry[key]

    if rope_type == "default":
        return theta, None
    if rope_type == "linear":
        return theta, RopeScaling("linear", float(need("factor")))
    return theta, RopeScaling("llama3", float(need("factor")), float(need("low_freq_factor")),
                              float(need("high_freq_factor")),
                              int(need("original_max_position_embeddings")))


def _check_unsupported(config: dict, model_type: str) -> None:
    family = FAMILIES[model_type]
    act = config.get("hidden_act", family.activations[0])
    if act not in family.activations:
        what = "SwiGLU (hidden_act 'silu')" if family.activations == SILU else "GeGLU (gelu_pytorch_tanh)"
        raise _refuse("hidden_act", act, f"{model_type}'s MLP is {what}")
    if config.get("mlp_bias"):
        raise _refuse("mlp_bias", True, "MLP biases are not implemented")
    if model_type != "qwen2" and config.get("attention_bias"):
        raise _refuse("attention_bias", True,
                      f"{model_type} with attention_bias also biases o_proj, which is not implemented")
    for field in ("attn_logit_softcapping", "final_logit_softcapping"):
        if config.get(field) is not None and field not in family.fields:
            raise _refuse(field, config[field], f"{model_type} has no soft-capping")
    if config.get("quantization_config"):
        method = config["quantization_config"].get("quant_method", config["quantization_config"])
        raise _refuse("quantization_config", method, "pre-quantized checkpoints are not implemented")
    if config.get("use_mrope"):
        raise _refuse("use_mrope", True, "multimodal RoPE is not implemented")


def config_from_hf(config: dict, name: str = "hf", *, strict_unknown: bool = False) -> ModelConfig:
    """A ModelConfig from a parsed config.json; ValueError naming any field it cannot honour."""
    model_type = _architecture(config)
    unknown = sorted(set(config) - READ_FIELDS - IGNORED_FIELDS - FAMILIES[model_type].fields)
    if unknown:
        message = f"config.json: unknown field(s) {', '.join(unknown)} (not read by jaxserve)"
        if strict_unknown:
            raise ValueError(message)
        log.warning("%s", message)
    _check_unsupported(config, model_type)
    defaults = FAMILY_DEFAULTS[model_type]
    num_heads = config["num_attention_heads"]
    hidden = config["hidden_size"]
    num_layers = config["num_hidden_layers"]
    kinds, window = _layer_kinds(config, model_type, num_layers)
    family = FAMILIES[model_type]
    extra = family.read(config)
    if len(set(kinds)) > 1:  # each kind its own RoPE (Gemma 3's local base)
        rope_theta, rope_scaling = _rope(config, kinds, "full_attention")
        local_theta, local_scaling = _rope(config, kinds, "sliding_attention")
        extra.update(layer_types=tuple(kinds), local_rope_theta=local_theta,
                     local_rope_scaling=local_scaling)
    else:
        only = kinds[0] if family.mixed_layers else None  # Gemma: all-local layers use the local RoPE
        rope_theta, rope_scaling = _rope(config, kinds, only)
    return ModelConfig(
        name=name,
        architecture=model_type,
        vocab_size=config["vocab_size"],
        hidden_size=hidden,
        intermediate_size=config["intermediate_size"],
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=config.get("num_key_value_heads") or num_heads,
        head_dim=config.get("head_dim") or hidden // num_heads,
        max_position_embeddings=config.get("max_position_embeddings", defaults["max_position_embeddings"]),
        rms_norm_eps=float(config.get("rms_norm_eps", defaults["rms_norm_eps"])),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        attention_bias=defaults["qkv_bias"],
        sliding_window=window,
        **extra,
    )


def read_hf_config(folder: str | os.PathLike) -> ModelConfig:
    """The ModelConfig of a Hugging Face folder's config.json (errors name the file)."""
    path = os.path.join(folder, "config.json")
    try:
        with open(path) as f:
            config = json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no config.json in the model folder") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: config.json is not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: config.json is not a JSON object")
    try:
        return config_from_hf(config, name=os.path.basename(os.path.normpath(folder)))
    except KeyError as e:
        raise ValueError(f"{path}: config.json lacks the field {e.args[0]!r}") from None
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
