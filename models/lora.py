"""LoRA adapters: the PEFT format read and checked against a base model, and the batched low-rank
products of the compiled step.

Axes as in models/llama.py (t tokens, e hidden, f MLP width), plus s adapter slots (slot 0 is the
zero adapter, "none"), r the rank padded to max_lora_rank (R), n a product's stacked ranks.

1. Format (`load_peft_adapter`): a folder with adapter_config.json (`r`, `lora_alpha`,
   `target_modules`, `use_rslora`) and adapter_model.safetensors with tensors named
   `base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight`, A [r, in] and
   B [out, r]. The scale is alpha / r, or alpha / sqrt(r) with rsLoRA, folded into B at load.
   Every field that changes the computation is read or refused by name (DoRA, biases,
   modules_to_save, per-module rank or alpha patterns, fan_in_fan_out); a tensor of an unknown
   module, of a layer past the model's depth, of a shape the base layer does not have, a rank
   above max_lora_rank, an A without its B: errors naming the tensor or the field.
2. Layout (`LoRAWeights`, host numpy; `allocate_lora_buffers`, on the device): one pair per
   served product (models/served_layout.py: qkv_proj, o_proj, gate_up_proj, down_proj). A fused
   product stacks its modules' A matrices on n (q, k, v: n = 3R; gate, up: n = 2R) and keeps one
   B [out, R] whose rows belong to one module each (its `segments`), so no block-diagonal zeros
   are stored or multiplied. Device buffers: a [L, s, n, in], b [L, out, s, R], out-major like
   the base weights (a layer's a is one [s * n, in] matrix, a segment's b one [out, s * R]
   matrix, so "masked" runs two plain 2-D products); a rank below R is zero-padded (exact: zero
   columns add nothing).
3. Products (`lora_delta`): y += B_slot(A_slot x) for every token of the ragged batch, each
   with its row's slot (`StepInputs.lora_slots`). Three forms, fixed shapes all (so adding,
   swapping or mixing adapters never recompiles):
   - "gather": each token's A and B gathered (Punica's BGMV done by XLA);
   - "ragged": tokens sorted by slot, `jax.lax.ragged_dot_general` per group (S-LoRA / MoE
     style; on the CPU XLA lowers it to a product over every group);
   - "masked": every slot's shrink for every token, the other slots' zeroed, one expand over
     all slots as a single [t, s * R] x [s * R, out] product (what "ragged" is on the CPU,
     spelled as two plain dots).
   `LORA_PRODUCT` picks per platform, from measurement (BUILD_NOTES.md, "LoRA"); "auto" picks
   gather for small buckets and masked for large ones. With rank buckets (a static `rank` per
   compiled step, EngineConfig.lora_rank_buckets) the products stop at the step's highest rank.
4. `merge_lora`: the reference, W + scale * B A merged into loader-layout weights.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig

# PEFT module name -> (served product, segment index, HF sub-block).
TARGET_MODULES = {
    "q_proj": ("qkv_proj", 0, "self_attn"), "k_proj": ("qkv_proj", 1, "self_attn"),
    "v_proj": ("qkv_proj", 2, "self_attn"), "o_proj": ("o_proj", 0, "self_attn"),
    "gate_proj": ("gate_up_proj", 0, "mlp"), "up_proj": ("gate_up_proj", 1, "mlp"),
    "down_proj": ("down_proj", 0, "mlp"),
}
LORA_PRODUCTS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
LORA_METHODS = ("gather", "ragged", "masked")
# "auto": per bucket, "gather" up to GATHER_MAX_TOKENS tokens (each token reads its own adapter's
# rows), "masked" above (every slot's weights read once for all tokens). On the 2-core CPU masked
# was fastest at 32-row decode and at prefill (BUILD_NOTES.md "LoRA", exp_lora); accelerators
# group by adapter (not measured: no accelerator was lent).
LORA_PRODUCT = {"cpu": "masked", "gpu": "ragged", "tpu": "ragged"}
GATHER_MAX_TOKENS = 32

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_TENSOR = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
# adapter_config.json keys that cannot change the served computation (training or bookkeeping).
_IGNORED_KEYS = {
    "base_model_name_or_path", "revision", "task_type", "inference_mode", "lora_dropout",
    "init_lora_weights", "auto_mapping", "peft_version", "megatron_config", "megatron_core",
    "loftq_config", "eva_config", "corda_config", "layer_replication", "runtime_config",
    "lora_bias", "exclude_modules", "target_parameters", "trainable_token_indices",
    "qalora_group_size", "use_qalora", "alora_invocation_tokens", "arrow_config",
    "ensure_weight_tying",
}


class LoRAError(ValueError):
    """A LoRA adapter that cannot be served: the message names the file, tensor or field."""


@dataclasses.dataclass(frozen=True)
class ProductShape:
    """One served product's LoRA geometry: its input width and its output rows per segment."""

    in_dim: int
    segments: tuple[tuple[int, int], ...]  # (start, end) rows of the fused output, one per module

    @property
    def out_dim(self) -> int:
        return self.segments[-1][1]


def product_shapes(config: ModelConfig) -> dict[str, ProductShape]:
    """The products an adapter may modify for `config` (a mixture of experts: attention only)."""
    e, d, f = config.hidden_size, config.head_dim, config.intermediate_size
    q, kv = config.num_heads * d, config.num_kv_heads * d
    shapes = {"qkv_proj": ProductShape(e, ((0, q), (q, q + kv), (q + kv, q + 2 * kv))),
              "o_proj": ProductShape(q, ((0, e),))}
    if not config.num_experts:
        shapes["gate_up_proj"] = ProductShape(e, ((0, f), (f, 2 * f)))
        shapes["down_proj"] = ProductShape(f, ((0, e),))
    return shapes


def module_shape(config: ModelConfig, module: str) -> tuple[int, int]:
    """(out, in) of a PEFT target module's base weight (HF layout)."""
    product, segment, _ = TARGET_MODULES[module]
    shape = product_shapes(config)[product]
    start, end = shape.segments[segment]
    return end - start, shape.in_dim


@dataclasses.dataclass
class LoRAWeights:
    """One adapter in host memory, checked and laid out for the device slots (module docstring)."""

    path: str
    rank: int  # the adapter's r
    scale: float  # alpha / r, or alpha / sqrt(r) (rsLoRA); already folded into `b`
    target_modules: tuple[str, ...]
    a: dict[str, np.ndarray]  # product -> [L, n, in] float32, n = segments * max_lora_rank
    b: dict[str, np.ndarray]  # product -> [L, out, max_lora_rank] float32, times scale
    # per-module (A [L, r, in] or None, B [L, out, r] or None, unscaled), for merge_lora
    modules: dict[str, tuple[np.ndarray, np.ndarray]] = dataclasses.field(repr=False, default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in (*self.a.values(), *self.b.values()))


def read_adapter_config(path: str, max_lora_rank: int) -> tuple[int, float, tuple[str, ...], bool]:
    """(r, scale, target modules, rsLoRA) from adapter_config.json, strictly."""
    file = os.path.join(path, CONFIG_FILE)
    if not os.path.isdir(path):
        raise LoRAError(f"{path}: no such adapter folder")
    try:
        with open(file) as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise LoRAError(f"{file}: missing (a PEFT adapter folder has adapter_config.json and "
                        f"{WEIGHTS_FILE})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise LoRAError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise LoRAError(f"{file}: must hold a JSON object")
    peft_type = raw.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise LoRAError(f"{file}: peft_type={peft_type!r}; only LORA adapters are served")
    r = raw.get("r")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise LoRAError(f"{file}: r must be a positive integer, got {r!r}")
    if r > max_lora_rank:
        raise LoRAError(f"{file}: r={r} exceeds max_lora_rank={max_lora_rank} (raise max_lora_rank)")
    alpha = raw.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or alpha <= 0:
        raise LoRAError(f"{file}: lora_alpha must be a positive number, got {alpha!r}")
    rslora = raw.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise LoRAError(f"{file}: use_rslora must be a boolean, got {rslora!r}")
    targets = raw.get("target_modules")
    if isinstance(targets, str) or not isinstance(targets, list) or not targets:
        raise LoRAError(f"{file}: target_modules must be a non-empty list of module names "
                        f"(known: {', '.join(TARGET_MODULES)}), got {targets!r}")
    for name in targets:
        if name not in TARGET_MODULES:
            raise LoRAError(f"{file}: target_modules has {name!r}, which is not a module this engine "
                            f"adapts (known: {', '.join(TARGET_MODULES)})")
    refused = {"use_dora": False, "fan_in_fan_out": False, "bias": "none", "modules_to_save": None,
               "rank_pattern": {}, "alpha_pattern": {}, "layers_pattern": None}
    for key, neutral in refused.items():
        value = raw.get(key, neutral)
        if value != neutral and not (neutral is None and value in ([], {})) and not (
                neutral == {} and value is None):
            raise LoRAError(f"{file}: {key}={value!r} is not supported (only {neutral!r})")
    known = {"peft_type", "r", "lora_alpha", "use_rslora", "target_modules", "layers_to_transform",
             *refused, *_IGNORED_KEYS}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise LoRAError(f"{file}: unknown field(s) {', '.join(unknown)}; refusing rather than "
                        "guessing what they change")
    scale = alpha / math.sqrt(r) if rslora else alpha / r
    return r, float(scale), tuple(dict.fromkeys(targets)), rslora


def load_peft_adapter(path: str | os.PathLike, config: ModelConfig, max_lora_rank: int) -> LoRAWeights:
    """A PEFT LoRA folder as LoRAWeights for `config`'s base model (module docstring, 1-2)."""
    path = os.fspath(path)
    r, scale, targets, _ = read_adapter_config(path, max_lora_rank)
    shapes = product_shapes(config)
    for module in targets:
        if TARGET_MODULES[module][0] not in shapes:
            raise LoRAError(f"{path}: target module {module!r}: the base model has no dense "
                            f"{module} (a mixture of experts; only attention is adapted)")
    file = os.path.join(path, WEIGHTS_FILE)
    if not os.path.exists(file):
        raise LoRAError(f"{file}: missing")
    from safetensors import safe_open

    tensors: dict[tuple[int, str, str], np.ndarray] = {}
    try:
        with safe_open(file, framework="np") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                m = _TENSOR.match(key)
                if m is None:
                    raise LoRAError(f"{file}: tensor {key!r} is not a LoRA A/B weight of a decoder "
                                    "layer (expected base_model.model.model.layers.N.<self_attn|mlp>."
                                    "<module>.lora_<A|B>.weight)")
                layer, block, module, which = int(m[1]), m[2], m[3], m[4]
                if module not in TARGET_MODULES or TARGET_MODULES[module][2] != block:
                    raise LoRAError(f"{file}: tensor {key!r}: unknown module {block}.{module} "
                                    f"(known: {', '.join(TARGET_MODULES)})")
                if module not in targets:
                    raise LoRAError(f"{file}: tensor {key!r}: module {module!r} is not in "
                                    f"target_modules {list(targets)}")
                if layer >= config.num_layers:
                    raise LoRAError(f"{file}: tensor {key!r}: layer {layer}, but the base model has "
                                    f"{config.num_layers} layers")
                tensors[(layer, module, which)] = np.asarray(f.get_tensor(key), np.float32)
    except LoRAError:
        raise
    except Exception as e:  # noqa: BLE001 - a broken file, named
        raise LoRAError(f"{file}: corrupted or not a safetensors file ({type(e).__name__}: {e})") from None
    if not tensors:
        raise LoRAError(f"{file}: no LoRA tensors")
    num_layers, R = config.num_layers, max_lora_rank
    modules: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for module in targets:
        out, inp = module_shape(config, module)
        a_all = np.zeros((num_layers, r, inp), np.float32)
        b_all = np.zeros((num_layers, out, r), np.float32)
        found = False
        for layer in range(num_layers):
            a, b = tensors.get((layer, module, "A")), tensors.get((layer, module, "B"))
            if (a is None) != (b is None):
                which = "lora_B" if b is None else "lora_A"
                raise LoRAError(f"{file}: layer {layer} {module}: {which}.weight is missing")
            if a is None:
                continue  # not adapted in this layer (layers_to_transform)
            found = True
            name = f"model.layers.{layer}.{TARGET_MODULES[module][2]}.{module}"
            if a.shape != (r, inp):
                raise LoRAError(f"{file}: tensor {name}.lora_A.weight has shape {list(a.shape)}, expected "
                                f"[r={r}, {inp}] for the base model's {module}")
            if b.shape != (out, r):
                raise LoRAError(f"{file}: tensor {name}.lora_B.weight has shape {list(b.shape)}, expected "
                                f"[{out}, r={r}] for the base model's {module}")
            if not (np.isfinite(a).all() and np.isfinite(b).all()):
                raise LoRAError(f"{file}: tensor {name}: non-finite values")
            a_all[layer], b_all[layer] = a, b
        if not found:
            raise LoRAError(f"{file}: target module {module!r} has no tensors")
        modules[module] = (a_all, b_all)
    a_out, b_out = {}, {}
    for product, shape in shapes.items():
        a = np.zeros((num_layers, len(shape.segments) * R, shape.in_dim), np.float32)
        b = np.zeros((num_layers, shape.out_dim, R), np.float32)
        for module, (prod, segment, _) in TARGET_MODULES.items():
            if prod != product or module not in modules:
                continue
            start, end = shape.segments[segment]
            a[:, segment * R : segment * R + r] = modules[module][0]
            b[:, start:end, :r] = modules[module][1] * scale
        a_out[product], b_out[product] = a, b
    return LoRAWeights(path, r, scale, targets, a_out, b_out, modules)


# ---- device buffers and the step's products ------------------------------------------------


def lora_buffer_shapes(config: ModelConfig, num_slots: int, max_lora_rank: int) -> dict:
    """product -> {"a": shape, "b": shape}; num_slots counts slot 0 (the zero adapter)."""
    n, R = config.num_layers, max_lora_rank
    return {p: {"a": (n, num_slots, len(s.segments) * R, s.in_dim), "b": (n, s.out_dim, num_slots, R)}
            for p, s in product_shapes(config).items()}


SLOT_AXIS = {"a": 1, "b": 2}  # the slot axis of each buffer


def allocate_lora_buffers(config: ModelConfig, num_slots: int, max_lora_rank: int, dtype) -> dict:
    return {p: {k: jnp.zeros(shape, dtype) for k, shape in ab.items()}
            for p, ab in lora_buffer_shapes(config, num_slots, max_lora_rank).items()}


def write_slot(buffers: dict, slot, values: dict) -> dict:
    """buffers with slot `slot` (traced) set to `values` (product -> {"a": [L, n, in], "b": [L,
    out, R]}); jitted with the buffers donated (engine/lora/slots.py)."""
    out = {}
    for product, ab in buffers.items():
        out[product] = {k: jax.lax.dynamic_update_index_in_dim(
            buf, values[product][k].astype(buf.dtype), slot, axis=SLOT_AXIS[k]) for k, buf in ab.items()}
    return out


def _expand(u, b, segments, rank, spec):
    """u [..., n] -> [t, out]: segment j's rows of b take u's j-th block of `rank` columns."""
    parts = [jnp.einsum(spec, u[..., j * rank : (j + 1) * rank], b[..., start:end, :],
                        preferred_element_type=jnp.float32)
             for j, (start, end) in enumerate(segments)]
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=-1)


def lora_delta(x, a, b, slots, layer, segments, *, method: str, rank: int | None = None):
    """B_slot A_slot x for every token: x [t, in], a [L, s, n, in], b [L, out, s, R], slots int32[t]
    (0: the zero adapter), layer an int or a traced index -> float32 [t, out]. `rank` (static):
    over each segment's first `rank` columns only, exact when no token's adapter has more."""
    x = x.astype(a.dtype)
    if rank is not None and rank < b.shape[-1]:
        a_l = jax.lax.dynamic_index_in_dim(a, layer, keepdims=False)  # [s, n, in]
        a = a_l.reshape(a_l.shape[0], len(segments), -1, a_l.shape[-1])[:, :, :rank]
        a = a.reshape(1, a_l.shape[0], len(segments) * rank, a_l.shape[-1])
        b, layer = jax.lax.dynamic_index_in_dim(b, layer, keepdims=True)[..., :rank], 0
    rank = b.shape[-1]
    if method == "gather":
        a_t, b_t = a[layer, slots], b[layer, :, slots]  # [t, n, in], [t, out, R]
        u = jnp.einsum("ti,tni->tn", x, a_t, preferred_element_type=jnp.float32).astype(a.dtype)
        return _expand(u, b_t, segments, rank, "tr,tor->to")
    a_l = jax.lax.dynamic_index_in_dim(a, layer, keepdims=False)  # [s, n, in]
    b_l = jax.lax.dynamic_index_in_dim(b, layer, keepdims=False)  # [out, s, R]
    num_slots, n = a_l.shape[0], a_l.shape[1]
    t = x.shape[0]
    if method == "masked":  # two plain 2-D products per segment: [t, in] x [s*n, in], [t, s*R] x [out, s*R]
        u = jnp.einsum("ti,ki->tk", x, a_l.reshape(num_slots * n, -1), preferred_element_type=jnp.float32)
        mine = slots[:, None] == jnp.arange(num_slots, dtype=slots.dtype)[None, :]
        u = jnp.where(mine[:, :, None], u.reshape(t, num_slots, n), 0.0).astype(a.dtype)  # [t, s, n]
        parts = [jnp.einsum("tk,ok->to", u[:, :, j * rank : (j + 1) * rank].reshape(t, -1),
                            b_l[start:end].reshape(end - start, -1), preferred_element_type=jnp.float32)
                 for j, (start, end) in enumerate(segments)]
        return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=-1)
    if method == "ragged":
        from models.moe import grouped_product

        order = jnp.argsort(slots, stable=True)
        sizes = jnp.bincount(slots, length=num_slots).astype(jnp.int32)
        u = grouped_product(x[order], a_l, sizes).astype(a.dtype)  # [t, n]
        parts = [grouped_product(u[:, j * rank : (j + 1) * rank], jnp.moveaxis(b_l[start:end], 1, 0), sizes)
                 for j, (start, end) in enumerate(segments)]
        y = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=-1)
        return jnp.zeros_like(y).at[order].set(y)
    raise ValueError(f"lora method must be one of {', '.join(LORA_METHODS)}, got {method!r}")


class LoRAStep:
    """The adapters of one step, as models/llama.py applies them: wraps a layer's weight products
    so that each adds its LoRA delta (before any bias, activation or all-reduce: under tensor
    parallelism a row-parallel product's partial delta joins the same psum)."""

    def __init__(self, buffers: dict, slots, config: ModelConfig, method: str, rank: int | None = None):
        """rank: the step's rank bucket (static; None: max_lora_rank), at least the rank of every
        adapter whose slot a token of the step uses (engine/step/model_runner.py picks it)."""
        self.buffers = buffers
        self.slots = slots
        self.shapes = product_shapes(config)
        if method == "auto":  # per bucket: the token count is static
            method = "gather" if slots.shape[0] <= GATHER_MAX_TOKENS else "masked"
        self.method = method
        self.rank = rank

    def wrap(self, product, layer):
        def with_lora(name, *args):
            y = product(name, *args)
            if name not in self.buffers:
                return y
            ab = self.buffers[name]
            return y + lora_delta(args[0], ab["a"], ab["b"], self.slots, layer,
                                  self.shapes[name].segments, method=self.method, rank=self.rank)

        return with_lora


# ---- the reference -------------------------------------------------------------------------


def merge_lora(params: dict, config: ModelConfig, weights: LoRAWeights) -> dict:
    """Loader-layout params (a list of layers, numpy or jax) with W + scale * B A merged in, as a
    new pytree (float32 arithmetic, cast back to each weight's dtype)."""
    heads = {"q_proj": ("wq", config.num_heads), "k_proj": ("wk", config.num_kv_heads),
             "v_proj": ("wv", config.num_kv_heads)}
    layers = []
    for i, layer in enumerate(params["layers"]):
        layer = dict(layer)
        for module, (a_all, b_all) in weights.modules.items():
            delta = weights.scale * (b_all[i] @ a_all[i])  # [out, in] (HF layout)
            if module in heads:
                name, n = heads[module]
                d = delta.T.reshape(config.hidden_size, n, config.head_dim)
            elif module == "o_proj":
                name, d = "wo", delta.T.reshape(config.num_heads, config.head_dim, config.hidden_size)
            else:
                name = {"gate_proj": "w_gate", "up_proj": "w_up", "down_proj": "w_down"}[module]
                d = delta.T
            w = layer[name]
            layer[name] = (np.asarray(w, np.float32) + d).astype(np.asarray(w).dtype)
        layers.append(layer)
    return {**params, "layers": layers}
