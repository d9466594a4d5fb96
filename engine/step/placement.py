"""Placement: one replica's device group (a Mesh of shape (1, tp)) and how the model lives on it.

The runner gets a Placement when the engine runs on a mesh (tensor_parallel_size > 1, or one
replica of several); without one it keeps the single-device path unchanged. A Placement:
1. lays the loaded weights out for the mesh on the host (models/sharding.py: heads padded to a
   multiple of tp, q/k/v fused per shard, layers stacked) and places each device's shard directly
   (`place`); with quantization, quantizes them there (models/sharded_quant.py);
2. gives the KV cache's sharding (split on KV heads; an 8-bit cache's values and scales alike)
   and the replicated sharding of everything else (step inputs, the request table, the
   sampler's outputs);
3. returns the step's forward: models/llama.forward_paged under shard_map at tp > 1, the plain
   forward on the replica's single device at tp = 1;
4. reports the bytes each device holds (weights, KV cache).
"""

from __future__ import annotations

import dataclasses
import functools

from jax.sharding import Mesh, NamedSharding, PartitionSpec

from models.config import ModelConfig
from models.llama import forward_paged
from models.sharded_quant import quantize_sharded
from models.sharding import (
    MODEL_AXIS,
    TPLayout,
    bytes_per_device,
    forward_paged_sharded,
    kv_cache_spec,
    place_params,
    shard_params_host,
    tp_layout,
)
from pallas_kernels import kv_layout_for


@dataclasses.dataclass(frozen=True)
class Placement:
    mesh: Mesh  # axes ("data", "model"), shape (1, tp)
    layout: TPLayout

    @classmethod
    def for_mesh(cls, mesh: Mesh, config: ModelConfig, expert_parallel_size: int = 1) -> Placement:
        return cls(mesh, tp_layout(config, mesh.shape[MODEL_AXIS], expert_parallel_size))

    @property
    def tp(self) -> int:
        return self.layout.tp

    @property
    def devices(self) -> list:
        return list(self.mesh.devices.flat)

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    def kv_sharding(self, kv_layout: str) -> NamedSharding:
        """The cache's sharding: split on KV heads, wherever `kv_layout` puts them."""
        return NamedSharding(self.mesh, kv_cache_spec(kv_layout))

    def place(self, params: dict, config: ModelConfig, *, dtype: str, layer_loop: str,
              quantization: str | None = None, activation_rows: int | None = None) -> dict:
        """Loader-layout params (numpy or device arrays) -> the served layout, shard by shard
        (stacked on a layer axis for the "stacked" layer loop, engine/config.py); `quantization`:
        then quantized on the devices, each scale placed with its weight's output dim
        (models/sharded_quant.py)."""
        host = shard_params_host(params, config, self.layout, dtype=dtype, stack=layer_loop == "stacked",
                                 pack_bits=quantization is None)
        placed = place_params(host, self.mesh, config)
        del host
        if quantization is None:
            return placed
        return quantize_sharded(placed, self.layout, quantization, activation_rows=activation_rows,
                                mesh=self.mesh, config=config)

    def forward(self, *, attention_backend: str, interpret: bool, layer_loop: str, lora_method: str = "masked"):
        """(params, kv_cache, inputs) -> (kv_cache, logits [L, v]) for the compiled step."""
        kwargs = dict(attention_backend=attention_backend, interpret=interpret,
                      scan_layers=layer_loop != "unrolled", lora_method=lora_method,
                      kv_layout=kv_layout_for(attention_backend))
        if self.tp == 1:
            return functools.partial(_forward_single, config=self.layout.local, **kwargs)
        return functools.partial(_forward_tp, layout=self.layout, mesh=self.mesh, **kwargs)

    def bytes_per_device(self, tree) -> list[int]:
        """Bytes of `tree` on each device of the group, in mesh order."""
        held = bytes_per_device(tree)
        return [held.get(d, 0) for d in self.devices]


def _forward_single(params, kv_cache, inputs, *, config, **kwargs):
    return forward_paged(params, config, kv_cache, inputs, **kwargs)


def _forward_tp(params, kv_cache, inputs, *, layout, mesh, **kwargs):
    return forward_paged_sharded(params, layout, kv_cache, inputs, mesh=mesh, **kwargs)


def device_bytes(runner, placement: Placement | None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(weight bytes, KV-cache bytes) per device of the runner's group (a runner without device
    arrays, a fake one in tests: empty tuples)."""
    params, cache = getattr(runner, "params", None), getattr(runner, "kv_cache", None)
    if params is None or cache is None:
        return (), ()
    if placement is None:
        held_w, held_kv = bytes_per_device(params), bytes_per_device(cache)
        devices = sorted(set(held_w) | set(held_kv), key=lambda d: d.id)
        return tuple(held_w.get(d, 0) for d in devices), tuple(held_kv.get(d, 0) for d in devices)
    return tuple(placement.bytes_per_device(params)), tuple(placement.bytes_per_device(cache))
