"""What experiments.aot reports of a build: per-bucket results, the Build with its fit, byte
counts of abstract arrays, the collectives read from optimized HLO, and the target's figures
(experiments/lab/targets.py). aot_build.py makes Builds; experiments/aot.py prints and saves them.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import numpy as np

from engine.step.buckets import RunnerShapes
from experiments.lab.targets import compile_only_devices, target

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


@dataclasses.dataclass
class BucketResult:
    padded_tokens: int
    padded_seqs: int
    padded_logits: int
    compile_s: float
    temp_bytes: int  # per device, the compiler's temporaries
    code_bytes: int
    flops: float | None  # per device, from cost_analysis (None where the backend gives none)
    bytes_accessed: float | None
    roofline_step_s: float | None  # max(flops / peak, bytes / bandwidth) at the target's peaks
    decode_tok_s: float | None  # padded_seqs / roofline step, for a pure decode bucket (T == S)
    collectives_per_layer: dict
    collectives_outside_layers: dict
    executable: object = dataclasses.field(default=None, repr=False)
    error: str | None = None  # the compiler's refusal (out of memory), when it refused
    required_bytes: int | None = None  # what the refusing compiler said the program needs in all
    # per device: copies of KV-cache-shaped arrays in the optimized program (`cache_copy_bytes`),
    # temporaries that grow with the pool
    cache_copy_bytes: int = 0


def refused(bucket, seconds: float, message: str) -> BucketResult:
    """A bucket the compiler refused for memory, with the total its message states (XLA:TPU
    counts arguments and temporaries together there)."""
    found = re.search(r"temporaries \(([\d.]+)([KMGT])\)", message)
    temp = int(float(found.group(1)) * 1024 ** "KMGT".index(found.group(2)) * 1024) if found else 0
    first = message.strip().splitlines()[0] if message.strip() else message
    return BucketResult(bucket.padded_tokens, bucket.padded_seqs, bucket.padded_logits, seconds,
                        0, 0, None, None, None, None, {}, {}, None, first[:300], temp or None)


@dataclasses.dataclass
class Build:
    target: str
    platform: str
    dtype: str
    attention_backend: str
    layer_loop: str
    tensor_parallel_size: int
    max_model_len: int
    block_size: int
    num_blocks: int
    hbm_bytes: int  # per device
    usable_bytes: int  # what the runtime hands out (GPU: its preallocation fraction)
    weights_bytes: int  # per device
    kv_cache_bytes: int  # per device
    table_bytes: int  # per device (the request table: sampling state, output counts)
    kv_bytes_per_block: int  # per device, every layer's (with a sliding group kv_cache_bytes has both groups')
    buckets: list[BucketResult]
    shapes: RunnerShapes = None
    manifest: dict = None  # engine/step/executables.py: what a loading server must match
    transfers: list = dataclasses.field(default_factory=list)  # disaggregation's KV programs
    # speculative decoding's draft (draft_model: its runner; draft_head: its chain), when there is
    # one: method, weights_bytes, kv_cache_bytes, table_bytes, programs (each with compile_s, temp_bytes)
    draft: dict | None = None
    # per device, the cache as the compiled steps lay it out (`kv_bytes_as_laid_out`; the TPU's
    # tiles pad a small kv-head count and a head_dim under 128); None: as kv_cache_bytes
    kv_cache_laid_out_bytes: int | None = None

    @property
    def kv_layout_factor(self) -> float:
        """The cache's bytes as laid out over its values' and scales' (1.0: no padding)."""
        if not self.kv_cache_laid_out_bytes or not self.kv_cache_bytes:
            return 1.0
        return self.kv_cache_laid_out_bytes / self.kv_cache_bytes

    @property
    def temp_bytes(self) -> int:
        own = max((b.temp_bytes for b in self.buckets), default=0)
        return max([own, *(p["temp_bytes"] for p in self.draft["programs"])] if self.draft else [own])

    @property
    def draft_bytes(self) -> int:
        d = self.draft
        return d["weights_bytes"] + d["kv_cache_bytes"] + d["table_bytes"] if d else 0

    @property
    def total_bytes(self) -> int:
        kv = self.kv_cache_laid_out_bytes or self.kv_cache_bytes
        return self.weights_bytes + kv + self.table_bytes + self.temp_bytes + self.draft_bytes

    @property
    def fits(self) -> bool:
        refused = any(b.error for b in self.buckets) or any(
            p["error"] for p in (self.draft["programs"] if self.draft else []))
        return not refused and self.num_blocks >= 2 and self.total_bytes <= self.usable_bytes

    @property
    def cache_copy_bytes(self) -> int:
        return max((b.cache_copy_bytes for b in self.buckets), default=0)

    @property
    def max_kv_blocks(self) -> int:
        """The largest cache (blocks, with the null block) that fits beside the rest (a draft
        model's cache has as many blocks as the target's). Copies of the cache in the programs
        (`cache_copy_bytes`) are temporaries that grow with it: counted per block, not fixed."""
        d = self.draft
        draft_fixed = d["weights_bytes"] + d["table_bytes"] if d else 0
        draft_per_block = d["kv_cache_bytes"] // self.num_blocks if d else 0
        copies = self.cache_copy_bytes
        fixed_temp = max(0, self.temp_bytes - copies)
        free = self.usable_bytes - self.weights_bytes - self.table_bytes - fixed_temp - draft_fixed
        per_block = (self.kv_bytes_per_block * self.kv_layout_factor + draft_per_block
                     + copies / max(1, self.num_blocks))
        return max(0, int(free // per_block))


def kv_bytes_as_laid_out(buckets: list[BucketResult], kv_state) -> int | None:
    """Per device, the cache's bytes in the layout the first compiled bucket takes it in (its
    input formats: on the TPU the kernels' layout the runner pins, engine/step/program.py)."""
    from engine.step.program import cache_bytes

    for b in buckets:
        if b.executable is not None:
            return cache_bytes(kv_state, b.executable.input_formats[0][1])[0]
    return None


_HLO_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2, "s16": 2,
                 "u16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}


def cache_copy_bytes(hlo_text: str, kv_cache) -> int:
    """Bytes of the copies in an optimized program (`compiled.as_text()`) whose result has the
    per-device shape of one of the KV cache's arrays (values, or an 8-bit cache's scales): XLA
    relaying the cache out between its entry layout and a kernel's (docs/tpu_gpu.md: the TPU at
    2-3 kv heads a device), temporaries as large as the pool."""
    shapes = {tuple(device_shape(leaf)) for leaf in jax.tree.leaves(kv_cache)}
    total = 0
    for m in re.finditer(r"= (\w+)\[([\d,]*)\]\{[^}]*\} copy\(", hlo_text):
        dims = tuple(int(x) for x in m.group(2).split(",") if x)
        if dims in shapes:
            total += int(np.prod(dims, dtype=np.int64)) * _HLO_ITEMSIZE.get(m.group(1), 4)
    return total


def device_shape(leaf) -> tuple[int, ...]:
    """An abstract array's shape on one device (its shard's)."""
    return leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape


def nbytes(leaf) -> int:
    return int(np.prod(device_shape(leaf), dtype=np.int64)) * np.dtype(leaf.dtype).itemsize


def tree_bytes_per_device(tree) -> int:
    return sum(nbytes(leaf) for leaf in jax.tree.leaves(tree))


def with_sharding(tree, shardings):
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings)


def split_unrolled(total: dict, num_layers: int) -> tuple[dict, dict]:
    """An unrolled program's collectives (all in the entry) as (per layer, outside the layers):
    each layer holds the same ops, so the whole multiples of the layer count are the layers' and
    the rest (the embedding's, the logits') is outside, e.g. 65 all-reduces over 32 layers are 2
    a layer and 1 outside."""
    per_layer = {k: v // num_layers for k, v in total.items()}
    return per_layer, {k: v - per_layer[k] * num_layers for k, v in total.items()}


def count_collectives(hlo_text: str) -> tuple[dict, dict]:
    """(ops inside while-loop bodies, ops elsewhere) per collective kind, from optimized HLO text.
    Under a scan over layers the body is one layer; the rest is the embedding and the logits."""
    bodies = set(re.findall(r"body=%?([\w.\-]+)", hlo_text))
    inside = dict.fromkeys(COLLECTIVES, 0)
    outside = dict.fromkeys(COLLECTIVES, 0)
    current = None
    for line in hlo_text.splitlines():
        if line[:1] not in (" ", "") and line.rstrip().endswith("{"):  # a computation's header
            current = line.removeprefix("ENTRY ").split()[0].lstrip("%")
            continue
        for op in COLLECTIVES:
            if re.search(rf"\s{op}(-start)?\(", line):
                (inside if current in bodies else outside)[op] += 1
    return inside, outside


def devices_for(target_name: str, count: int) -> list:
    if target_name == "cpu":
        devices = jax.devices("cpu")
    else:
        devices = list(compile_only_devices(target_name))
    if count > len(devices):
        raise ValueError(f"target {target_name}: tensor_parallel_size x data_parallel_size needs "
                         f"{count} devices, the target has {len(devices)}")
    return devices[:count]


def target_figures(target_name: str) -> tuple[str, int, int, float, float]:
    """(platform, HBM bytes, usable bytes, peak FLOP/s, bandwidth) per device."""
    if target_name == "cpu":
        from experiments.lab.capacity_devices import device_spec

        spec = device_spec("cpu")
        return "cpu", int(spec.hbm_bytes), int(spec.hbm_bytes), spec.peak_flops, spec.bandwidth
    t = target(target_name)
    spec = t.spec
    return t.kind, t.hbm_bytes, int(t.hbm_bytes * spec.memory_fraction), spec.peak_flops, spec.bandwidth
