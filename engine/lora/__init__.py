"""Serving LoRA adapters over one base model (DESIGN.md section 16).

1. `manager.LoRAManager` (the engine's, host side): adapters by name (`--lora_modules`,
   /v1/load_lora_adapter) and by LoRARequest; each load reads and checks a PEFT folder against the
   base model (models/lora.py) into host memory, kept LRU up to max_cpu_loras; a request holds its
   adapter's host copy from submission to finish, so an eviction never strands it. Every load
   gets a fresh key, which is the request's `Request.lora_id`: the scheduler counts adapters by it
   (at most max_loras distinct ones run at once, scheduler/lora_seats.py) and the prefix cache
   keys blocks by it (scheduler/block_pool.py `root_hash`).
2. `slots.LoRASlots` (the runner's, device side): stacked buffers [L, max_loras + 1, ...] in
   the served weights' pytree (params["lora"]), slot 0 the zero adapter. A request joining the
   batch gets its adapter's slot, written from host memory if it is not resident (evicting the
   least recently used slot no running request holds); the write is one compiled, donated update,
   compiled at start-up, so nothing recompiles as adapters come and go.
3. In the step each token carries its row's slot (StepInputs.lora_slots) and every adapted
   product adds B_slot A_slot x (models/lora.py `lora_delta`).
"""

from engine.lora_config import LoRARequest

__all__ = ["LoRARequest"]
