"""LoRAManager: the engine's adapters by name and id, loaded and checked into host memory (LRU).

Thread-safe: the server loads adapters on its worker threads (so reading a folder never stalls
the step thread) while the engine resolves requests on its own.
- `add(LoRARequest)`: registers a name (--lora_modules, /v1/load_lora_adapter) and loads it now,
  so a broken folder is refused at once (models/lora.LoRAError naming the problem).
- `resolve(LoRARequest | name)`: the LoadedAdapter a request holds until it finishes; from the
  host cache, or read again from its folder if it was evicted.
- `remove(name)`: unregisters (requests already holding it finish with it).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import threading

from engine.errors import ParamError
from engine.lora_config import LoRARequest, parse_lora_modules
from models.config import ModelConfig
from models.lora import LoRAWeights, load_peft_adapter


@dataclasses.dataclass(frozen=True, eq=False)
class LoadedAdapter:
    request: LoRARequest
    weights: LoRAWeights
    key: int  # unique per load: the scheduler's Request.lora_id and the slots' identity

    @property
    def name(self) -> str:
        return self.request.lora_name


class LoRAManager:
    def __init__(self, model_config: ModelConfig, *, max_loras: int, max_lora_rank: int,
                 max_cpu_loras: int | None = None, lora_modules=None):
        self.model_config = model_config
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max_cpu_loras or max_loras
        self._lock = threading.Lock()
        self._host: collections.OrderedDict[int, LoadedAdapter] = collections.OrderedDict()  # by lora_int_id
        self._by_name: dict[str, LoRARequest] = {}
        self._seen: dict[int, LoRARequest] = {}  # lora_int_id -> its request, evicted or not
        self._keys = itertools.count(1)
        self._ids = itertools.count(1)
        self.num_disk_loads = 0
        for name, path in parse_lora_modules(lora_modules):
            self.add(LoRARequest(name, self.new_id(), path))

    def new_id(self) -> int:
        """An lora_int_id not used by any registered adapter."""
        with self._lock:
            used = {r.lora_int_id for r in self._by_name.values()} | set(self._host) | set(self._seen)
            while True:
                i = next(self._ids)
                if i not in used:
                    return i

    def names(self) -> list[str]:
        with self._lock:
            return list(self._by_name)

    def get(self, name: str) -> LoRARequest | None:
        with self._lock:
            return self._by_name.get(name)

    def add(self, request: LoRARequest) -> LoadedAdapter:
        """Registers `request` under its name and loads it (a LoRAError names what is wrong)."""
        with self._lock:
            if request.lora_name in self._by_name:
                raise ValueError(f"LoRA adapter {request.lora_name!r} is already loaded")
        adapter = self.resolve(request)
        with self._lock:
            self._by_name[request.lora_name] = request
        return adapter

    def remove(self, name: str) -> bool:
        with self._lock:
            request = self._by_name.pop(name, None)
            if request is None:
                return False
            self._host.pop(request.lora_int_id, None)
            self._seen.pop(request.lora_int_id, None)
            return True

    def resolve(self, request: LoRARequest | str) -> LoadedAdapter:
        """The adapter of a LoRARequest (or a registered name), from host memory or its folder."""
        if isinstance(request, str):
            found = self.get(request)
            if found is None:
                raise ValueError(f"lora_request: no LoRA adapter named {request!r} is loaded")
            request = found
        if not isinstance(request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(request).__name__}")
        with self._lock:
            seen = self._seen.get(request.lora_int_id)
            if seen is not None and seen != request:
                raise ValueError(f"lora_request: lora_int_id {request.lora_int_id} is already "
                                 f"{seen.lora_name!r} at {seen.lora_path!r}; "
                                 f"cannot also be {request.lora_name!r} at {request.lora_path!r}")
            held = self._host.get(request.lora_int_id)
            if held is not None:
                self._host.move_to_end(request.lora_int_id)
                return held
        weights = load_peft_adapter(request.lora_path, self.model_config, self.max_lora_rank)
        with self._lock:
            held = self._host.get(request.lora_int_id)  # another thread may have loaded it meanwhile
            if held is not None and held.request == request:
                return held
            adapter = LoadedAdapter(request, weights, next(self._keys))
            self._host[request.lora_int_id] = adapter
            self._seen[request.lora_int_id] = request
            self.num_disk_loads += 1
            while len(self._host) > self.max_cpu_loras:
                self._host.popitem(last=False)
            return adapter


def request_adapter(manager: LoRAManager | None, lora_request) -> LoadedAdapter | None:
    """The LoadedAdapter a request runs with, None for the base model: lora_request is an
    engine.LoRARequest, the name of a loaded adapter, or a LoadedAdapter the manager resolved
    already (on another thread). Errors are ParamErrors naming lora_request."""
    if lora_request is None:
        return None
    if manager is None:
        raise ParamError("lora_request", "lora_request: this engine serves no LoRA adapters "
                         "(start it with enable_lora=True)")
    if isinstance(lora_request, LoadedAdapter):
        return lora_request
    try:
        return manager.resolve(lora_request)
    except ValueError as exc:  # a LoRAError names the file, tensor or field
        raise ParamError("lora_request", f"lora_request: {exc}") from None
