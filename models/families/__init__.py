"""One module per model family: its transformers names, config defaults, own config fields,
tensor names and sharding table (models/families/base.py says what each declares). The decoder
itself is shared (models/llama.py over models/layers.py and models/moe.py)."""

from models.families import gemma, llama, mixtral, qwen3
from models.families.base import Family

FAMILIES: dict[str, Family] = {**llama.FAMILIES, **qwen3.FAMILIES, **gemma.FAMILIES, **mixtral.FAMILIES}

__all__ = ["FAMILIES", "Family"]
