"""Building an engine's parts from an EngineConfig: the model, the scheduler, the runner.

`LLMEngine(config)` calls `build_parts(config)`; tests and research code that want another runner
(a fake one, a sharded one) build the parts themselves and call `LLMEngine.from_parts`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time

import jax

from engine.config import (
    EngineConfig,
    resolve_activation_rows,
    resolve_dtype,
    resolve_layer_loop,
    resolve_max_model_len,
    resolve_smoothing,
)
from engine.step import cpu_compile, product_forms
from engine.step.buckets import (
    RunnerShapes,
    max_logit_rows,
    resolve_seq_buckets,
    resolve_token_buckets,
)
from engine.step.host_memory import reuse_freed_memory
from engine.step.kv_cache import cache_budget, pool_sizes
from engine.step.model_runner import ModelRunner
from engine.step.tpu_cache_layout import laid_out_factor
from models.loader import load_model
from pallas_kernels import cpu_native, resolve_backend
from pallas_kernels.kv_quant import scale_layout
from scheduler import Scheduler, SchedulerConfig

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class EngineParts:
    config: EngineConfig
    scheduler: Scheduler
    runner: object  # ModelRunner, or anything with its execute()/sample_vocab_size
    tokenizer: object
    max_model_len: int
    model_name: str
    model_config: object = None
    dtype: str = "float32"
    attention_backend: str = "xla"
    load_seconds: float = 0.0
    compile_seconds: float = 0.0
    proposer: object = None  # speculative decoding's proposer when it needs parts (a draft model)
    placement: object = None  # engine/step/placement.Placement on a mesh; None: one device
    lora_manager: object = None  # engine/lora/manager.LoRAManager with enable_lora; None: off


def default_placement(config: EngineConfig):
    """A (1, tp) mesh over the first tp devices when tensor_parallel_size > 1; None otherwise."""
    if config.tensor_parallel_size == 1:
        return None
    from engine.step.mesh import replica_meshes

    return replica_meshes(config.tensor_parallel_size, 1)[0]


def scheduler_config_for(config: EngineConfig, *, max_model_len: int, num_blocks: int,
                         sliding_window: int | None = None, num_sliding_blocks: int = 0) -> SchedulerConfig:
    return SchedulerConfig(
        sliding_window=sliding_window, num_sliding_blocks=num_sliding_blocks,
        max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=max_model_len, block_size=config.block_size, num_blocks=num_blocks,
        enable_prefix_caching=config.enable_prefix_caching,
        enable_chunked_prefill=config.enable_chunked_prefill, policy=config.policy,
        kv_allocation=config.kv_allocation, max_num_logits=max_logit_rows(config),
        max_seqs_per_group=(None if config.max_request_share >= 1
                            else max(1, int(config.max_request_share * config.max_num_seqs))),
        max_loras=config.max_loras if config.enable_lora else 0)


def uses_sliding_groups(config: EngineConfig, model) -> bool:
    """Sliding-window block accounting (scheduler/sliding_window.py) for a model with sliding-window
    layers: a KV cache group per layer kind when it mixes them with global ones (Gemma 2/3), the
    sliding group alone when every layer slides (Mistral v0.1; engine/step/kv_cache.py
    cache_groups). Not with disable_hybrid_kv_cache_manager, the baselines (contiguous allocation
    and the static policy reserve whole sequences or prompts up front), disaggregation (whose pools
    move blocks of every layer), nor, when every layer slides, a draft model (it reads the global
    tables, which then hold no memory)."""
    spec = config.speculative_config
    draft_model = spec is not None and spec.method == "draft_model"
    return (model.has_sliding_layers and not config.disable_hybrid_kv_cache_manager
            and config.kv_allocation == "paged" and config.policy != "static"
            and config.disaggregation is None and (model.mixes_windows or not draft_model))


def load_for_mesh(config: EngineConfig, *, progress: bool = True):
    """The model in host memory, for engines that place their own shards (one load, N replicas)."""
    dtype = resolve_dtype(config, jax.devices()[0].platform)
    return load_model(config.model, dtype=dtype, seed=config.seed, tokenizer=config.tokenizer,
                      progress=progress, cache_dir=config.weights_cache_dir, host=True)


def build_parts(config: EngineConfig, *, progress: bool = True, mesh=None, loaded=None,
                keep_hidden: bool = False) -> EngineParts:
    """The parts of one engine (one replica). `mesh`: its device group (engine/step/mesh.py), None:
    a (1, tensor_parallel_size) mesh when that is > 1, else the default device. `loaded`: a
    LoadedModel already in host memory (data parallelism loads once for all replicas).
    `keep_hidden`: the runner keeps each step's final hidden states on the device (a draft head
    needs them; experiments/train_draft.py records them)."""
    enable_compilation_cache(config.compilation_cache_dir)
    mesh = mesh if mesh is not None else default_placement(config)
    platform = jax.devices()[0].platform
    reuse_freed_memory(config.cpu_reuse_freed_memory, platform)  # the CPU: XLA:CPU temporaries reused
    dtype = resolve_dtype(config, platform)
    backend = resolve_backend(config.attention_backend, platform)
    if backend != "xla" and platform == "cpu" and not config.interpret:
        raise ValueError(
            f"EngineConfig.attention_backend={config.attention_backend!r}: Pallas kernels do not "
            "compile for the CPU; pass interpret=True to run them in Pallas interpret mode "
            "(slow, for tests), or use attention_backend='xla' (the CPU path)")
    rows = rows_kernel(config, platform, backend)  # before loading executables: they may call it
    start = time.perf_counter()
    if loaded is None:
        loaded = load_model(config.model, dtype=dtype, seed=config.seed, tokenizer=config.tokenizer,
                            progress=progress, cache_dir=config.weights_cache_dir, host=mesh is not None,
                            native_blocks=config.quantization == "gguf")
    placement, params, kv_config = None, loaded.params, loaded.config
    layer_loop = resolve_layer_loop(config, platform)
    if mesh is not None:
        from engine.step.placement import Placement

        placement = Placement.for_mesh(mesh, loaded.config, config.expert_parallel_size)
        params = placement.place(loaded.params, loaded.config, dtype=dtype, layer_loop=layer_loop,
                                 quantization=config.quantization,
                                 activation_rows=resolve_activation_rows(config, platform))
        kv_config = placement.layout.local  # per device: its KV heads, after its weight shards
    smoothing = resolve_smoothing(config, platform)
    if smoothing is not None and placement is None:  # (a mesh: refused by EngineConfig, off by default)
        from models.smoothing import smooth_for_quantization

        # The calibration pass over models/smoothing.py CALIBRATION_TEXT, then the factors folded
        # in; the runner quantizes the smoothed float weights.
        params, calibration = smooth_for_quantization(params, loaded.config, loaded.tokenizer, smoothing)
        logger.info("quantization smoothing (alpha %s): calibrated and folded in %.2f s", smoothing, calibration)
    load_seconds = time.perf_counter() - start
    max_model_len = resolve_max_model_len(config, loaded.config.max_position_embeddings)
    bs = config.block_size
    max_blocks_per_seq = -(-max_model_len // bs)
    sliding = uses_sliding_groups(config, loaded.config)
    sliding_window = loaded.config.sliding_window if sliding else None
    device = placement.devices[0] if placement else jax.devices()[0]
    budget = cache_budget(device, config.kv_cache_bytes, config.kv_cache_memory_fraction)
    if backend == "pallas_tpu" and platform == "tpu" and config.num_kv_blocks is None:
        # The kernels' layout pads the cache (engine/step/tpu_cache_layout.py): the budget holds fewer blocks.
        budget = int(budget / laid_out_factor(kv_config, block_size=config.block_size, dtype=dtype,
                                              kv_cache_dtype=config.kv_cache_dtype, device=device))
    num_blocks, num_sliding_blocks = pool_sizes(config, kv_config, budget, sliding=sliding, dtype=dtype,
                                                max_model_len=max_model_len, scale_layout=scale_layout(backend))
    if (num_blocks - 1) * bs < max_model_len:
        raise ValueError(
            f"the KV cache ({num_blocks - 1} blocks of {bs} tokens) cannot hold one request of "
            f"max_model_len={max_model_len} tokens: raise num_kv_blocks / kv_cache_bytes "
            "or lower max_model_len")
    scheduler = Scheduler(scheduler_config_for(config, max_model_len=max_model_len, num_blocks=num_blocks,
                                               sliding_window=sliding_window,
                                               num_sliding_blocks=num_sliding_blocks))
    shapes = RunnerShapes(
        token_buckets=resolve_token_buckets(config), seq_buckets=resolve_seq_buckets(config),
        max_blocks_per_seq=max_blocks_per_seq, num_blocks=num_blocks, block_size=bs,
        num_sliding_blocks=num_sliding_blocks,
        num_logprobs=config.max_logprobs,
        sample_vocab_size=min(loaded.config.vocab_size, loaded.tokenizer.vocab_size),
        logits_per_seq=1 + (config.speculative_config.num_speculative_tokens
                            if config.speculative_config is not None else 0),
        prompt_scoring=config.prompt_scoring_bucket,
        lora_ranks=(config.lora_rank_buckets or ()) if config.enable_lora else ())
    spec = config.speculative_config
    if spec is not None and spec.method in ("draft_model", "draft_head") and placement is not None:
        raise ValueError(f"speculative_config method {spec.method!r} runs on one device: use "
                         "tensor_parallel_size=1 and data_parallel_size=1 with it (ngram works on a mesh)")
    head = None
    if spec is not None and spec.method == "draft_head":
        from engine.spec_decode.draft_head import load_head

        head = load_head(spec.model)  # before compiling anything: a bad folder fails fast
    executables = None
    if config.load_executables:
        from engine.step.executables import load_executables, manifest

        devices = placement.devices if placement else jax.devices()[:1]
        expected = manifest(platform=platform, device_kind=devices[0].device_kind, model=loaded.config,
                            dtype=dtype, attention_backend=backend, layer_loop=layer_loop,
                            tensor_parallel_size=config.tensor_parallel_size, shapes=shapes,
                            quantization=config.quantization,
                            activation_rows=resolve_activation_rows(config, platform),
                            kv_cache_dtype=config.kv_cache_dtype,
                            smoothing=smoothing if placement is None else None, rows_kernel=rows)
        executables = load_executables(config.load_executables, expected, devices)
    lora_manager, lora_slots, lora_method = None, None, "masked"
    if config.enable_lora:
        from engine.lora.manager import LoRAManager
        from engine.lora.slots import LoRASlots
        from models.lora import LORA_PRODUCT

        # The adapters named at start-up are read (and checked) before anything compiles.
        lora_manager = LoRAManager(loaded.config, max_loras=config.max_loras, max_lora_rank=config.max_lora_rank,
                                   max_cpu_loras=config.max_cpu_loras, lora_modules=config.lora_modules)
        lora_slots = LoRASlots(loaded.config, max_loras=config.max_loras, max_lora_rank=config.max_lora_rank,
                               dtype=dtype, placement=placement)
        lora_method = config.lora_product or LORA_PRODUCT.get(platform, "ragged")
    start = time.perf_counter()
    runner = ModelRunner(loaded.config, params, shapes, dtype=dtype, attention_backend=backend,
                         interpret=config.interpret, layer_loop=layer_loop,
                         precompile=config.precompile,
                         background_compile=config.background_compile, progress=progress, placement=placement,
                         keep_hidden=keep_hidden or head is not None, executables=executables,
                         lora=lora_slots, lora_method=lora_method,
                         quantization=None if config.quantization == "gguf" else config.quantization,  # gguf: loaded quantized
                         activation_rows=resolve_activation_rows(config, platform),
                         kv_cache_dtype=config.kv_cache_dtype, warmup=config.warmup,
                         product_forms=cpu_product_forms(config, shapes, executables) if platform == "cpu" and placement is None else None,
                         compiler_options=compiler_options(config, platform), rows_kernel=rows)
    proposer = None
    if spec is not None and spec.method == "draft_model":
        proposer = build_draft_proposer(config, shapes, loaded, dtype=dtype, backend=backend,
                                        platform=platform, max_model_len=max_model_len,
                                        progress=progress)
    elif head is not None:
        from engine.spec_decode.draft_head import DraftHeadProposer

        cfg, head_params, vocab_map, _ = head
        proposer = DraftHeadProposer(runner, cfg, head_params, vocab_map, spec.num_speculative_tokens,
                                     min_confidence=spec.draft_confidence_threshold,
                                     precompile=config.precompile)
    return EngineParts(
        config=config, scheduler=scheduler, runner=runner, tokenizer=loaded.tokenizer,
        max_model_len=max_model_len, model_name=_model_name(config.model, loaded.config.name),
        model_config=loaded.config, dtype=dtype, attention_backend=backend,
        load_seconds=load_seconds, compile_seconds=time.perf_counter() - start, proposer=proposer,
        placement=placement, lora_manager=lora_manager)


def build_draft_proposer(config: EngineConfig, shapes: RunnerShapes, target, *, dtype: str,
                         backend: str, platform: str, max_model_len: int, progress: bool):
    """The draft model's own runner (same buckets and block tables as the target's, one more
    token bucket for rows catching up, one logit row per sequence) inside a DraftModelProposer."""
    from engine.spec_decode.draft_model import DraftModelProposer

    spec = config.speculative_config
    draft = load_model(spec.model, dtype=dtype, seed=config.seed, tokenizer=config.tokenizer,
                       progress=progress, cache_dir=config.weights_cache_dir)
    if draft.tokenizer.vocab_size != target.tokenizer.vocab_size:
        raise ValueError(f"speculative_config.model={spec.model!r}: its tokenizer has "
                         f"{draft.tokenizer.vocab_size} ids, the target's {target.tokenizer.vocab_size}; "
                         "a draft model must share the target's tokenizer")
    if draft.config.max_position_embeddings < max_model_len:
        raise ValueError(f"speculative_config.model={spec.model!r}: its context "
                         f"({draft.config.max_position_embeddings}) is shorter than max_model_len "
                         f"({max_model_len})")
    draft_shapes = dataclasses.replace(
        shapes, token_buckets=(*shapes.token_buckets, shapes.token_buckets[-1] + shapes.max_num_seqs),
        num_logprobs=0, logits_per_seq=1, sample_vocab_size=min(shapes.sample_vocab_size, draft.config.vocab_size),
        prompt_scoring=False, lora_ranks=(),  # the draft model never scores a prompt nor runs an adapter
        num_sliding_blocks=0)  # one cache group over the target's global tables (block_ids)
    runner = ModelRunner(draft.config, draft.params, draft_shapes, dtype=dtype, attention_backend=backend,
                         interpret=config.interpret, layer_loop=resolve_layer_loop(config, platform),
                         precompile=config.precompile,
                         background_compile=config.background_compile, progress=progress,
                         warmup=config.warmup, compiler_options=compiler_options(config, platform),
                         rows_kernel=rows_kernel(config, platform, backend))
    return DraftModelProposer(runner, spec.num_speculative_tokens)


def rows_kernel(config: EngineConfig, platform: str, backend: str) -> str:
    """How the runner's decode rows run (pallas_kernels/xla_forms.py ROWS_KERNELS), from
    EngineConfig.cpu_attention_kernel: the native kernel on the CPU's xla path where it builds
    (pallas_kernels/cpu_native.py; "auto" falls back to the jnp page loop with a warning naming
    why, "native" is an error there), the jnp page loop everywhere else."""
    choice = config.cpu_attention_kernel
    if platform != "cpu" or backend != "xla":
        if choice == "native":
            raise ValueError(f"EngineConfig.cpu_attention_kernel='native' runs on the CPU's xla attention "
                             f"path; this engine runs {backend!r} on {platform!r}")
        return "jnp"
    if choice == "jnp":
        return "jnp"
    if cpu_native.available():
        return "native"
    if choice == "native":
        raise ValueError(f"EngineConfig.cpu_attention_kernel='native': {cpu_native.unavailable_reason()}")
    logger.warning("the native CPU attention kernel is unavailable (%s); decode rows run the jnp page loop",
                   cpu_native.unavailable_reason())
    return "jnp"


def compiler_options(config: EngineConfig, platform: str):
    """token rows -> XLA's options for a runner's compile of a program of that many rows: on the
    CPU, the vector width its loops prefer (engine/step/cpu_compile.py); elsewhere None."""
    if platform != "cpu":
        return None
    return functools.partial(cpu_compile.compiler_options, config.cpu_vector_width)  # (EngineConfig checked it)


def cpu_product_forms(config: EngineConfig, shapes: RunnerShapes, executables: dict | None = None):
    """served params -> the CPU's product form table for the token and logit row counts of every
    bucket that compiles here, not loaded from `executables` (engine/step/product_forms.py;
    measured, or read from an earlier start's measurements)."""
    compiled = [b for b in shapes.all_buckets() if b not in (executables or {})]
    rows = sorted({n for b in compiled for n in (b.padded_tokens, b.padded_logits)})
    path = product_forms.measurements_path(jax.config.jax_compilation_cache_dir or None)  # the folder in use
    options = compiler_options(config, "cpu")  # the chains compile as the buckets will
    return lambda params: product_forms.resolve(config.cpu_product_form, params, rows, path=path,
                                                compiler_options=options)


def _model_name(spec: str, config_name: str) -> str:
    if spec == "default":
        return "SmolLM2-135M-Instruct"
    return config_name


def enable_compilation_cache(folder: str | None) -> None:
    if not folder or jax.config.jax_compilation_cache_dir:
        return  # off, or already chosen by the caller (tests, notebooks)
    jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
