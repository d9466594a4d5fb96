"""Load time of the default model: dequantizing the GGUF against restoring the orbax conversion.

    python -m experiments.bench.load --cache_dir=/tmp/jaxserve-convert

The first load dequantizes the GGUF and saves the converted parameters with orbax into cache_dir;
the second restores them. Median of --repeats loads each.
"""

from __future__ import annotations

import shutil
import statistics
import time

from absl import app, flags

_MODEL = flags.DEFINE_string("model", "default", "a GGUF model spec")
_CACHE = flags.DEFINE_string("cache_dir", "/tmp/jaxserve-convert", "where the orbax conversion goes")
_DTYPE = flags.DEFINE_string("dtype", "float32", "parameter dtype")
_REPEATS = flags.DEFINE_integer("repeats", 3, "loads per arm")


def main(argv) -> None:
    del argv
    import jax

    from models.loader import load_model

    shutil.rmtree(_CACHE.value, ignore_errors=True)

    def timed(**kwargs):
        start = time.perf_counter()
        loaded = load_model(_MODEL.value, dtype=_DTYPE.value, progress=False, **kwargs)
        jax.block_until_ready(loaded.params)
        return time.perf_counter() - start, loaded

    gguf_times = [timed()[0] for _ in range(_REPEATS.value)]
    first, _ = timed(cache_dir=_CACHE.value)  # dequantize + orbax save
    restores = []
    for _ in range(_REPEATS.value):
        seconds, loaded = timed(cache_dir=_CACHE.value)
        assert loaded.from_cache
        restores.append(seconds)
    print(f"model {_MODEL.value} ({_DTYPE.value}): GGUF load median {statistics.median(gguf_times):.2f}s; "
          f"first load with conversion save {first:.2f}s; orbax restore median {statistics.median(restores):.2f}s "
          f"({statistics.median(gguf_times) / statistics.median(restores):.1f}x faster)")


if __name__ == "__main__":
    app.run(main)
