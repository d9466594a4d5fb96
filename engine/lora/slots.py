"""LoRASlots: the device slots of the runner, filled from host memory on demand, evicted LRU.

Slot 0 is the zero adapter (rows without one); slots 1..max_loras hold adapters, each keyed by its
load's key (engine/lora/manager.py). A slot is held while any request in the runner's batch uses
it; only slots nobody holds are evicted (least recently used first). The scheduler admits at most
max_loras distinct adapters at once (scheduler/lora_seats.py), so a joining request always finds
a slot; if it does not, that is a bug and the step fails naming it.
"""

from __future__ import annotations

import collections

import jax
import numpy as np

from models.config import ModelConfig
from models.lora import SLOT_AXIS, allocate_lora_buffers, lora_buffer_shapes, write_slot
from models.sharding import shard_lora_values
from scheduler import SchedulerOutput


class LoRASlots:
    def __init__(self, config: ModelConfig, *, max_loras: int, max_lora_rank: int, dtype, placement=None):
        """placement (engine/step/placement.py): on a mesh the buffers are laid out for the padded,
        per-shard fused weights and split like them (models/sharding.py LORA_SPLITS)."""
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.config = config
        self.layout = None if placement is None else placement.layout
        shape_config = config if placement is None else placement.layout.padded
        if placement is None:
            self.buffers = allocate_lora_buffers(config, max_loras + 1, max_lora_rank, dtype)
            self._write = jax.jit(write_slot, donate_argnums=(0,))
        else:
            from jax.sharding import NamedSharding

            from models.sharding import MODEL_AXIS, lora_partition_specs

            abstract = jax.eval_shape(lambda: allocate_lora_buffers(shape_config, max_loras + 1, max_lora_rank, dtype))
            shardings = jax.tree.map(lambda spec: NamedSharding(placement.mesh, spec),
                                     lora_partition_specs(abstract, MODEL_AXIS))
            self.buffers = jax.jit(lambda: allocate_lora_buffers(shape_config, max_loras + 1, max_lora_rank, dtype),
                                   out_shardings=shardings)()
            self._write = jax.jit(write_slot, donate_argnums=(0,), out_shardings=shardings)
        self._key_of_slot: list[int | None] = [None] * (max_loras + 1)
        self._rank_of_slot = [0] * (max_loras + 1)  # the adapter's r (slot 0, the zero adapter: 0)
        self._slot_of_key: dict[int, int] = {}
        self._refs = [0] * (max_loras + 1)
        self._idle: collections.OrderedDict[int, None] = collections.OrderedDict()  # held by nobody, LRU first
        self._never_used = list(range(max_loras, 0, -1))  # pop() hands out slot 1 first
        self.slot_of_req: dict[str, int] = {}
        self.num_loads = 0  # host -> device slot writes
        self.num_evictions = 0
        # Compile the slot write now (writing zeros into slot 0), so loading an adapter later
        # never compiles.
        zeros = {p: {k: np.zeros(shape[:SLOT_AXIS[k]] + shape[SLOT_AXIS[k] + 1:], np.float32)
                     for k, shape in ab.items()}
                 for p, ab in lora_buffer_shapes(shape_config, max_loras + 1, max_lora_rank).items()}
        self.buffers = self._write(self.buffers, np.int32(0), zeros)

    @property
    def resident_keys(self) -> list[int]:
        return [k for k in self._key_of_slot if k is not None]

    def apply(self, out: SchedulerOutput) -> None:
        """Releases the slots of requests that left; gives the joining ones theirs."""
        for ids in (out.finished_req_ids, out.aborted_req_ids, out.preempted_req_ids):
            for req_id in ids:
                self.release(req_id)
        for new in out.new_requests:
            adapter = getattr(new.sampling, "lora", None)
            if adapter is not None:
                self.acquire(new.req_id, adapter)

    def acquire(self, req_id: str, adapter) -> int:
        """The slot of `adapter` (a manager.LoadedAdapter) for `req_id`, loaded if needed."""
        if req_id in self.slot_of_req:
            raise ValueError(f"LoRA slots: {req_id!r} already holds slot {self.slot_of_req[req_id]}")
        slot = self._slot_of_key.get(adapter.key)
        if slot is None:
            if self._never_used:
                slot = self._never_used.pop()
            elif self._idle:
                slot, _ = self._idle.popitem(last=False)
                del self._slot_of_key[self._key_of_slot[slot]]
                self.num_evictions += 1
            else:
                raise RuntimeError(f"LoRA slots: all {self.max_loras} slots are held by running requests "
                                   f"(adapter {adapter.name!r} for {req_id!r}); the scheduler admits at "
                                   "most max_loras distinct adapters")
            values = {p: {"a": adapter.weights.a[p], "b": adapter.weights.b[p]} for p in self.buffers}
            if self.layout is not None:
                values = shard_lora_values(adapter.weights.a, adapter.weights.b, self.config, self.layout)
            self.buffers = self._write(self.buffers, np.int32(slot), values)
            self._key_of_slot[slot] = adapter.key
            self._rank_of_slot[slot] = adapter.weights.rank
            self._slot_of_key[adapter.key] = slot
            self.num_loads += 1
        self._idle.pop(slot, None)
        self._refs[slot] += 1
        self.slot_of_req[req_id] = slot
        return slot

    def step_rank(self, out: SchedulerOutput) -> int:
        """The highest rank among the adapters of the step's rows (0: every row is the base
        model's): the step's products may stop at that column of each slot (models/lora.py
        lora_delta's `rank`), the others being zeros for these rows. Called after apply(out)."""
        slot_of, rank_of = self.slot_of_req, self._rank_of_slot
        return max((rank_of[slot_of[sr.req_id]] for sr in out.scheduled if sr.req_id in slot_of), default=0)

    def release(self, req_id: str) -> None:
        slot = self.slot_of_req.pop(req_id, None)
        if slot is None:
            return
        self._refs[slot] -= 1
        if not self._refs[slot]:
            self._idle[slot] = None
