"""The acceptance measurement of issue 29 on Gemma-3-27B's shapes (52 sliding layers, window
1024, 10 global): at 8x the window a request holds at most half the KV of the same model with
every layer global (experiments/bench/sliding_blocks.py, the block manager alone: pure Python)."""

from experiments.bench.sliding_blocks import measure
from models.config import preset_config


def test_gemma3_27b_holds_under_half_the_kv_at_eight_windows():
    r = measure(preset_config("gemma3-27b"), 8192, block_size=16, chunk=2048)
    assert (r["num_global"], r["num_sliding"]) == (512, 64)  # 8192 tokens; the window's 1023 + 1
    assert r["peak_sliding"] == 64 + 2048 // 16  # during a prefill step: its chunk's blocks too
    assert r["ratio"] <= 0.5 and round(r["ratio"], 3) == 0.266  # (10 x 512 + 52 x 64) / (62 x 512)
