"""DisaggregationConfig: prefill/decode disaggregation's knobs, validated (engine/disaggregation/).

`EngineConfig(disaggregation=...)` takes an instance, a dict of these fields, or the string form
`"prefill:2,decode:2"` (optionally `,max_pending_transfers:8,prefill_num_kv_blocks:64,
decode_num_kv_blocks:512,decode_address:HOST:PORT`), which is also what `--disaggregation` on the server takes. Every
error names the knob. No jax here: configs are built before jax is imported.
"""

from __future__ import annotations

import dataclasses

_PREFIX = "EngineConfig.disaggregation"


@dataclasses.dataclass(frozen=True)
class DisaggregationConfig:
    prefill: int  # devices of the prefill pool (its tensor-parallel size)
    decode: int  # devices of the decode pool (its tensor-parallel size)
    # Requests whose KV has moved to the decode pool but that the decode scheduler has not admitted
    # yet (their blocks are pinned there); at this many, new requests wait before the prefill pool.
    max_pending_transfers: int = 8
    prefill_num_kv_blocks: int | None = None  # the prefill pool's KV cache; None: num_kv_blocks
    decode_num_kv_blocks: int | None = None  # the decode pool's KV cache; None: num_kv_blocks
    # HOST:PORT of a decode pool in another process (`python -m engine.disaggregation.decode_pool
    # --listen=...`, on this host or another); None: the decode pool is the next `decode` devices of
    # this process.
    decode_address: str | None = None

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name == "decode_address":
                if value is not None and (not isinstance(value, str) or ":" not in value):
                    raise ValueError(f"{_PREFIX}.decode_address must be HOST:PORT, got {value!r}")
                continue
            if value is None and field.name.endswith("num_kv_blocks"):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{_PREFIX}.{field.name} must be a positive integer, got {value!r}")
        for name in ("prefill_num_kv_blocks", "decode_num_kv_blocks"):
            value = getattr(self, name)
            if value is not None and value < 2:
                raise ValueError(f"{_PREFIX}.{name} must be >= 2 (block 0 is the null block), got {value}")
        if self.prefill != self.decode:
            raise ValueError(
                f"{_PREFIX}: the prefill pool ({self.prefill} devices) and the decode pool ({self.decode}) "
                "must be the same size: each pool's tensor-parallel size is its device count, and the KV "
                "blocks move between them in one layout (heads padded and split alike)")

    @property
    def num_devices(self) -> int:
        return self.prefill + self.decode

    @classmethod
    def from_value(cls, value) -> DisaggregationConfig | None:
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            value = _parse(value)
        if not isinstance(value, dict):
            raise ValueError(f"{_PREFIX} must be a DisaggregationConfig, a dict or a string like "
                             f"'prefill:2,decode:2', got {type(value).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"{_PREFIX}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        missing = [name for name in ("prefill", "decode") if name not in value]
        if missing:
            raise ValueError(f"{_PREFIX}: {' and '.join(missing)} missing (e.g. 'prefill:2,decode:2')")
        return cls(**value)


def _parse(text: str) -> dict:
    out = {}
    for part in text.split(","):
        name, sep, number = part.strip().partition(":")
        if not sep:
            raise ValueError(f"{_PREFIX}: {part.strip()!r} is not NAME:COUNT (e.g. 'prefill:2,decode:2')")
        if name.strip() == "decode_address":
            out["decode_address"] = number.strip()
            continue
        try:
            out[name.strip()] = int(number)
        except ValueError:
            raise ValueError(f"{_PREFIX}.{name.strip()} must be an integer, got {number.strip()!r}") from None
    return out
