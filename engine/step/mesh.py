"""Device groups: one `jax.sharding.Mesh` per replica, axes ("data", "model").

`data_parallel_size` x `tensor_parallel_size` devices are taken from `jax.devices()` (all
processes' devices under jax.distributed, in the order JAX lists them) or from a given list, and
laid out as a [dp, tp] grid: row r is replica r's device group, its tensor-parallel shards along
"model". Each replica gets its own Mesh of shape (1, tp) over its row, so its arrays never touch
another replica's devices (DESIGN.md section 12). Sizes that the devices cannot satisfy are a
ValueError naming the knob.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

DATA_AXIS = "data"
MODEL_AXIS = "model"
AXES = (DATA_AXIS, MODEL_AXIS)


def device_grid(tensor_parallel_size: int = 1, data_parallel_size: int = 1, devices=None) -> np.ndarray:
    """The [dp, tp] array of devices the engine runs on (the first dp * tp devices)."""
    for name, value in (("tensor_parallel_size", tensor_parallel_size),
                        ("data_parallel_size", data_parallel_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"EngineConfig.{name} must be a positive integer, got {value!r}")
    devices = list(jax.devices() if devices is None else devices)
    needed = tensor_parallel_size * data_parallel_size
    if needed > len(devices):
        raise ValueError(
            f"EngineConfig.tensor_parallel_size={tensor_parallel_size} x "
            f"data_parallel_size={data_parallel_size} needs {needed} devices, but only "
            f"{len(devices)} are present ({devices[0].platform if devices else 'none'}); on the CPU "
            "set XLA_FLAGS=--xla_force_host_platform_device_count=N before jax is imported")
    return np.array(devices[:needed], dtype=object).reshape(data_parallel_size, tensor_parallel_size)


def make_mesh(tensor_parallel_size: int = 1, data_parallel_size: int = 1, devices=None) -> Mesh:
    """The whole engine's mesh, shape (dp, tp), axes ("data", "model")."""
    return Mesh(device_grid(tensor_parallel_size, data_parallel_size, devices), AXES)


def replica_meshes(tensor_parallel_size: int = 1, data_parallel_size: int = 1, devices=None) -> list[Mesh]:
    """One Mesh of shape (1, tp) per replica, over that replica's row of the grid."""
    grid = device_grid(tensor_parallel_size, data_parallel_size, devices)
    return [Mesh(grid[r : r + 1], AXES) for r in range(data_parallel_size)]


def check_divides(name: str, count: int, tensor_parallel_size: int) -> None:
    """For dimensions that cannot be padded (none of the llama family's today): a clear error."""
    if count % tensor_parallel_size:
        raise ValueError(f"EngineConfig.tensor_parallel_size={tensor_parallel_size} does not divide "
                         f"the model's {name} ({count})")


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())
