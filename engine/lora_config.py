"""The LoRA knobs of EngineConfig (enable_lora, max_loras, max_lora_rank, max_cpu_loras,
lora_modules), checked by name, and `LoRARequest`, how a request names its adapter (vLLM's).

Plain Python, no jax: the server imports it. What serving adapters means is engine/lora/.
"""

from __future__ import annotations

import dataclasses

# Features that do not run with adapters yet: refused by name when enable_lora is on.
_REFUSED_WITH_LORA = {
    "data_parallel_size": lambda c: c.data_parallel_size != 1,
    "num_processes": lambda c: c.num_processes != 1,
    "disaggregation": lambda c: c.disaggregation is not None,
    "policy='static'": lambda c: c.policy == "static",
    "expert_parallel_size": lambda c: c.expert_parallel_size != 1,
    "load_executables": lambda c: c.load_executables is not None,
}


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """An adapter by name, a positive integer id and the path of its PEFT folder (vLLM's
    `LoRARequest(lora_name, lora_int_id, lora_path)`)."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"LoRARequest.lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest.lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"LoRARequest.lora_path must be a non-empty string, got {self.lora_path!r}")


def parse_lora_modules(entries) -> list[tuple[str, str]]:
    """("name=path", ...) -> [(name, path)], each name once."""
    out: dict[str, str] = {}
    for entry in entries or ():
        name, sep, path = str(entry).partition("=")
        if not sep or not name or not path:
            raise ValueError(f"EngineConfig.lora_modules: {entry!r} is not 'name=path'")
        if name in out:
            raise ValueError(f"EngineConfig.lora_modules: the name {name!r} is given twice")
        out[name] = path
    return list(out.items())


def _positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"EngineConfig.{name} must be a positive integer, got {value!r}")


def check_lora_config(config) -> None:
    """Validates EngineConfig's LoRA fields (called from its __post_init__)."""
    if not isinstance(config.enable_lora, bool):
        raise ValueError(f"EngineConfig.enable_lora must be a boolean, got {config.enable_lora!r}")
    _positive("max_loras", config.max_loras)
    _positive("max_lora_rank", config.max_lora_rank)
    if config.max_cpu_loras is not None:
        _positive("max_cpu_loras", config.max_cpu_loras)
        if config.max_cpu_loras < config.max_loras:
            raise ValueError(f"EngineConfig.max_cpu_loras ({config.max_cpu_loras}) must be >= max_loras "
                             f"({config.max_loras}): an adapter in a device slot is also kept in host memory")
    if config.lora_product is not None and config.lora_product not in ("gather", "ragged", "masked", "auto"):
        raise ValueError(f"EngineConfig.lora_product must be one of gather, ragged, masked, auto, got "
                         f"{config.lora_product!r}")
    if config.lora_rank_buckets is not None:
        ranks = tuple(config.lora_rank_buckets)
        object.__setattr__(config, "lora_rank_buckets", ranks)
        if (not ranks or any(isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in ranks)
                or list(ranks) != sorted(set(ranks)) or ranks[-1] != config.max_lora_rank):
            raise ValueError(f"EngineConfig.lora_rank_buckets must be increasing integers >= 0 ending at "
                             f"max_lora_rank ({config.max_lora_rank}), got {ranks!r}")
        if not config.enable_lora:
            raise ValueError("EngineConfig.lora_rank_buckets needs enable_lora=True")
        if config.tensor_parallel_size != 1:
            raise ValueError("EngineConfig.lora_rank_buckets: tensor_parallel_size does not run with LoRA "
                             "rank buckets yet (one device only)")
    if config.lora_modules is not None:
        object.__setattr__(config, "lora_modules", tuple(config.lora_modules))
        parse_lora_modules(config.lora_modules)
    if not config.enable_lora:
        if config.lora_modules:
            raise ValueError("EngineConfig.lora_modules needs enable_lora=True")
        return
    for name, refused in _REFUSED_WITH_LORA.items():
        if refused(config):
            raise ValueError(f"EngineConfig.enable_lora: {name} does not run with LoRA adapters yet")
