"""KV blocks a request holds with sliding-window accounting, measured on the block manager.

    python -m experiments.bench.sliding_blocks --model=random:gemma3-27b --contexts=4096,8192,32768

For each context c, one request of c - 1 prompt tokens runs through the Scheduler with
sliding-window accounting (scheduler/sliding_window.py; pure Python, a fake step samples token 1):
its prompt in chunks of max_num_batched_tokens, then one decode step, which leaves c tokens
computed. The blocks it holds then are read off the two pools, and the most the sliding pool held
during any step (after schedule(): the window's blocks plus the chunk's, before update()
releases). KV held is counted in layer-blocks (one layer's K and V of one block: a global block
holds the global layers only, a sliding block the sliding layers only; a model whose every layer
slides has no global layers, its global pool holds no memory) against the same model with every
layer global (one block table: every block of every layer), and in GiB at `--itemsize`.
"""

from __future__ import annotations

from absl import app, flags

from models.config import preset_config
from scheduler import Request, Scheduler, SchedulerConfig, StepResult
from scheduler.sliding_window import num_blocks_needed

FLAGS = flags.FLAGS


def define_flags() -> None:
    """Defined only when run as a program (a test imports `measure` beside other modules)."""
    flags.DEFINE_string("model", "random:gemma3-27b", "A random:<preset> with sliding-window layers "
                        "(models/config.py PRESETS).")
    flags.DEFINE_list("contexts", ["4096", "8192", "32768"], "Context lengths (tokens) to measure at.")
    flags.DEFINE_integer("block_size", 16, "Tokens per KV block.")
    flags.DEFINE_integer("max_num_batched_tokens", 2048, "Prefill chunk (token budget per step).")
    flags.DEFINE_integer("itemsize", 2, "Bytes per K/V value (2: bfloat16).")


def measure(config, context: int, block_size: int, chunk: int, itemsize: int = 2) -> dict:
    window = config.sliding_window
    max_model_len = context + 3  # the request stops at 3 output tokens, after the measurement
    scheduler = Scheduler(SchedulerConfig(
        max_num_seqs=1, max_num_batched_tokens=chunk, max_model_len=max_model_len, block_size=block_size,
        num_blocks=-(-max_model_len // block_size) + 1, sliding_window=window,
        num_sliding_blocks=num_blocks_needed(window=window, block_size=block_size, max_num_seqs=1,
                                             max_num_batched_tokens=chunk, max_model_len=max_model_len)))
    request = Request("r", [2 + i % 1000 for i in range(context - 1)], 3, ignore_eos=True)
    scheduler.add_request(request)
    kv = scheduler.kv_cache_manager
    peak = 0
    while request.num_computed_tokens < context:
        output = scheduler.schedule()
        peak = max(peak, kv.sliding.pool.num_used_blocks)  # during the step: its chunk's blocks too
        scheduler.update(output, StepResult([sr.req_id for sr in output.scheduled if sr.sample],
                                            [[1] for sr in output.scheduled if sr.sample]))
    num_global, num_sliding = kv.pool.num_used_blocks, kv.sliding.pool.num_used_blocks
    layers_g = config.num_layers_of_kind("full_attention")
    layers_s = config.num_layers_of_kind("sliding_attention")
    two = num_global * layers_g + num_sliding * layers_s
    one = num_global * config.num_layers
    layer_block = 2 * block_size * config.num_kv_heads * config.head_dim * itemsize
    return dict(context=context, num_global=num_global, num_sliding=num_sliding, peak_sliding=peak,
                two=two, one=one, ratio=two / one, gib_two=two * layer_block / 2**30,
                gib_one=one * layer_block / 2**30)


def main(argv) -> None:
    del argv
    if not FLAGS.model.startswith("random:"):
        raise ValueError(f"--model={FLAGS.model!r}: a random:<preset> (its shape is all this needs)")
    config = preset_config(FLAGS.model.split(":", 1)[1])
    if not config.has_sliding_layers:
        raise ValueError(f"--model={FLAGS.model!r} has no sliding-window layers")
    print(f"{config.name}: {config.num_layers_of_kind('sliding_attention')} sliding layers (window "
          f"{config.sliding_window}) + {config.num_layers_of_kind('full_attention')} global, block_size "
          f"{FLAGS.block_size}, chunks of {FLAGS.max_num_batched_tokens}")
    print(f"{'context':>8} {'global':>7} {'sliding':>8} {'peak sl.':>9} {'layer-blocks':>13} "
          f"{'all global':>11} {'ratio':>6} {'GiB':>7} {'GiB all gl.':>11}")
    for c in FLAGS.contexts:
        r = measure(config, int(c), FLAGS.block_size, FLAGS.max_num_batched_tokens, FLAGS.itemsize)
        print(f"{r['context']:>8} {r['num_global']:>7} {r['num_sliding']:>8} {r['peak_sliding']:>9} "
              f"{r['two']:>13,} {r['one']:>11,} {r['ratio']:>6.3f} {r['gib_two']:>7.3f} {r['gib_one']:>11.3f}")


if __name__ == "__main__":
    define_flags()
    app.run(main)
