"""EngineConfig: every knob of the engine, frozen and validated, with vLLM's names.

Derived values (the resolved dtype, the bucket lists in engine/step/buckets.py, the number of KV
blocks) are computed by functions that return them; nothing is written back into the config.
Each list of choices has one home: policies and KV allocations in scheduler/config.py, attention
backends in pallas_kernels/backend.py.
"""

from __future__ import annotations

import dataclasses
import os

from engine.disaggregation_config import DisaggregationConfig
from engine.lora_config import check_lora_config
from engine.speculative_config import SpeculativeConfig
from models.kv_bytes import KV_CACHE_DTYPES
from models.weight_formats import QUANTIZATIONS
from scheduler.config import KV_ALLOCATIONS, POLICIES

DTYPES = ("float32", "bfloat16", "float16")
DEFAULT_COMPILATION_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "jaxserve", "jax")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    model: str = "default"  # "default", a GGUF file, a HF folder, an orbax folder, random:<name>
    tokenizer: str | None = None  # tokenizer path when the model path carries none
    dtype: str | None = None  # None: float32 on the CPU, bfloat16 on accelerators
    quantization: str | None = None  # weights quantized at load, per output channel (models/quant.py): "int8" or "fp8" (e4m3); "gguf": a GGUF's Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/Q2_K/Q3_K/Q4_K/Q5_K/Q6_K tensors (tables, and a dense model's layer products) served in their own blocks (int8 codes, float32 block scales; models/gguf_blocks.py), the rest dequantized to the dtype; None: the dtype's weights
    quantization_activation_rows: int | None = None  # with quantization: products of at least this many rows quantize their activations too (int8 x int8 -> int32 / fp8 x fp8, dynamic per-row scales), smaller ones convert the weights inside a float dot; None: the platform's measured default (QUANT_ACTIVATION_ROWS); 0: every product; a number above max_num_batched_tokens: none
    quantization_smoothing: str | float | None = None  # with int8/fp8: SmoothQuant-style smoothing before quantizing (models/smoothing.py: per-channel factors from a calibration pass over a fixed text at load, folded into the norms and weights), its migration strength alpha in [0, 1] (e.g. 0.5) or "off"; None: the platform's measured default (QUANT_SMOOTHING; one device, no LoRA, some product quantizing its activations). Not on a mesh nor with LoRA
    attention_backend: str = "auto"  # auto: Pallas on TPU/GPU, xla on the CPU
    interpret: bool = False  # run Pallas kernels in interpret mode (CPU tests)
    scan_layers: bool | None = None  # compile one layer (a lax.scan over layers); None: the platform's default
    stack_layer_weights: bool | None = None  # under scan_layers: weights stacked on a layer axis (True) or per-layer buffers picked by lax.switch (False); None: the platform's default
    max_num_seqs: int = 32  # requests in one step
    max_num_batched_tokens: int = 256  # tokens in one step (the token budget)
    max_model_len: int | None = None  # None: min(model context, 4096)
    block_size: int = 16  # tokens per KV block
    num_kv_blocks: int | None = None  # explicit KV cache size; overrides the two below
    kv_cache_memory_fraction: float = 0.85  # of free device memory (accelerators)
    kv_cache_bytes: int = 512 * 1024 * 1024  # byte budget on the CPU (per device on a mesh)
    kv_cache_dtype: str = "auto"  # auto (the model dtype) | int8 | fp8_e4m3: 8-bit K and V with a scale per token and kv head (pallas_kernels/kv_quant.py); every attention backend
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"  # fcfs | priority | static (baseline)
    # Fairness: one client request (its prompts and n samples) holds at most this fraction of
    # max_num_seqs running seats while other requests wait; 1.0 = no cap.
    max_request_share: float = 0.5
    kv_allocation: str = "paged"  # paged | contiguous (baseline)
    disable_hybrid_kv_cache_manager: bool = False  # True: one block table for every layer, so a model mixing sliding-window and global layers (Gemma 2/3) keeps every block in its sliding layers too; False: those layers get their own blocks, freed once their window has passed (scheduler/sliding_window.py; vLLM's name). Disaggregation's pools set it (imported blocks carry every layer)
    seed: int = 0  # random weights' seed and the default sampling key
    token_buckets: tuple[int, ...] | None = None  # padded token counts; None: derived
    seq_buckets: tuple[int, ...] | None = None  # padded request counts; None: derived
    compilation_cache_dir: str | None = DEFAULT_COMPILATION_CACHE  # None: off
    weights_cache_dir: str | None = None  # keep GGUF conversions here (orbax) for fast restarts
    load_executables: str | None = None  # a folder written by experiments.aot --save_executables: its compiled steps are loaded instead of compiling (after its manifest is checked against this engine)
    max_logprobs: int = 20  # most top logprobs a request may ask for
    prompt_scoring_bucket: bool = True  # compile the largest token bucket once more with a logit row per token, for the steps that score a prompt (prompt_logprobs; echo with logprobs): a scored prompt then advances by its share of the token budget under load; False: one executable fewer, and a scored prompt gets only the logit rows the other requests leave
    precompile: bool = True  # compile every bucket at start-up
    background_compile: bool = False  # with precompile: compile the smallest and largest buckets at start-up and the rest on a background thread (steps pad to a compiled bucket meanwhile); make serve turns it on
    cpu_product_form: str = "measured"  # on the CPU, the form of a float product of 2+ rows (models/weight_first.py): "measured" (both forms timed at start-up on the served weights for each bucket row count up to 64, int8 x int8 products too, kept per machine beside the compilation cache; models under 64 MiB of product weights keep the static rule), "static" (float32 weight-first from 2 rows, bfloat16 from 2 to 64), "weight_first" or "plain" (engine/step/product_forms.py)
    cpu_vector_width: str = "auto"  # on the CPU, the vector width XLA:CPU's own loops prefer (its xla_cpu_prefer_vector_width, given to each step's compile): "auto" (512 for the buckets of one token row where the CPU has AVX-512, measured: the one-row int8 step 1.33x faster; XLA's default, 256, for larger buckets and other CPUs), "256" or "512" for every bucket (engine/step/cpu_compile.py)
    cpu_attention_kernel: str = "auto"  # on the CPU, how attention's one-token rows (the decodes) run: "auto" (the native kernel, pallas_kernels/cpu_native.py, built on first use with the machine's C++ compiler: each row's pages read in place, the rows spread over XLA's threads; measured: the fixed workload at 32 requests 1.26x faster in float32; where it cannot be built, the jnp page loop, with a warning naming why), "native" (an error where it cannot be built) or "jnp" (the page loop XLA compiles)
    cpu_reuse_freed_memory: bool | None = None  # on the CPU: glibc malloc keeps the memory a step frees for the next (its mmap and trim thresholds raised to 1 GiB, process-wide; engine/step/host_memory.py), so XLA:CPU's per-step temporaries above 32 MiB are not mapped and zeroed afresh every step; None: where glibc is present, True: an error where it is not, False: the allocator as the process set it
    warmup: bool = True  # run each compiled bucket once on an all-padding step before any request does (XLA:CPU's first run of an executable costs ~0.3 s more than the next); buckets compiled in the background warm while the server is idle; False: the first step in each bucket pays it
    tensor_parallel_size: int = 1  # devices one model is split over (the mesh's "model" axis)
    data_parallel_size: int = 1  # replicas, each on its own tensor_parallel_size devices ("data")
    expert_parallel_size: int = 1  # a mixture of experts: the tensor_parallel_size devices form this many expert groups, each holding num_experts / expert_parallel_size experts (their MLP width split over the group's devices); attention, embeddings and head stay split over all tensor_parallel_size devices; 1: every device holds every expert's slice
    coordinator_address: str | None = None  # multi-host (jax.distributed): HOST:PORT of process 0's coordinator
    num_processes: int = 1  # multi-host: processes in the mesh (one per host)
    process_id: int = 0  # multi-host: this process (0 schedules and serves; the others follow)
    speculative_config: SpeculativeConfig | dict | None = None  # speculative decoding, vLLM's dict, e.g. {"method": "ngram", "num_speculative_tokens": 3} (keys: engine/speculative_config.py; a JSON object as a flag); None: off
    disaggregation: DisaggregationConfig | str | dict | None = None  # prefill/decode disaggregation over two device pools, e.g. "prefill:2,decode:2" (keys: engine/disaggregation_config.py); None: colocated
    enable_lora: bool = False  # serve LoRA adapters (PEFT folders) over the base model, per request (engine/lora/)
    max_loras: int = 1  # with enable_lora: adapter slots on the device (distinct adapters in one step)
    max_lora_rank: int = 16  # with enable_lora: the largest adapter rank; every slot is padded to it
    max_cpu_loras: int | None = None  # with enable_lora: adapters kept in host memory (LRU); None: max_loras
    lora_modules: tuple[str, ...] | None = None  # with enable_lora: adapters served from the start, each "name=path" (a flag: comma-separated)
    lora_rank_buckets: tuple[int, ...] | None = None  # with enable_lora: LoRA ranks to compile each shape for, increasing, the last max_lora_rank (e.g. 0,8,16); a step runs in the smallest holding its adapters' ranks (0: base rows only, no adapter products); None: one program per shape, every slot's whole rank
    lora_product: str | None = None  # with enable_lora: how the step computes the per-token adapter products, gather | ragged | masked | auto (gather for small token buckets, masked for large; models/lora.py); None: the platform's measured default

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"EngineConfig.model must be a non-empty string, got {self.model!r}")
        _choice("dtype", self.dtype, DTYPES, allow_none=True)
        from pallas_kernels.backend import ATTENTION_BACKENDS  # jax: only once a config is built

        _choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        _choice("policy", self.policy, POLICIES)
        _choice("kv_allocation", self.kv_allocation, KV_ALLOCATIONS)
        _choice("cpu_product_form", self.cpu_product_form, CPU_PRODUCT_FORMS)
        if self.cpu_vector_width in (256, 512) and not isinstance(self.cpu_vector_width, bool):  # as a number
            object.__setattr__(self, "cpu_vector_width", str(self.cpu_vector_width))
        _choice("cpu_vector_width", self.cpu_vector_width, CPU_VECTOR_WIDTHS)
        _choice("cpu_attention_kernel", self.cpu_attention_kernel, CPU_ATTENTION_KERNELS)
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        if self.max_model_len is not None:
            _positive("max_model_len", self.max_model_len)
        _positive("block_size", self.block_size)
        if self.num_kv_blocks is not None:
            _positive("num_kv_blocks", self.num_kv_blocks)
            if self.num_kv_blocks < 2:
                raise ValueError("EngineConfig.num_kv_blocks must be >= 2 (block 0 is the null block)")
        frac = self.kv_cache_memory_fraction
        if isinstance(frac, bool) or not isinstance(frac, int | float) or not 0 < frac <= 1:
            raise ValueError(f"EngineConfig.kv_cache_memory_fraction must be in (0, 1], got {frac!r}")
        _positive("kv_cache_bytes", self.kv_cache_bytes)
        share = self.max_request_share
        if isinstance(share, bool) or not isinstance(share, int | float) or not 0 < share <= 1:
            raise ValueError(f"EngineConfig.max_request_share must be in (0, 1], got {share!r}")
        _positive("max_logprobs", self.max_logprobs)
        _positive("tensor_parallel_size", self.tensor_parallel_size)
        _positive("data_parallel_size", self.data_parallel_size)
        _positive("expert_parallel_size", self.expert_parallel_size)
        if self.tensor_parallel_size % self.expert_parallel_size:
            raise ValueError(f"EngineConfig.expert_parallel_size={self.expert_parallel_size} must divide "
                             f"tensor_parallel_size={self.tensor_parallel_size} (the expert groups are "
                             "made of the tensor-parallel devices)")
        _positive("num_processes", self.num_processes)
        if isinstance(self.process_id, bool) or not isinstance(self.process_id, int) or not (
                0 <= self.process_id < self.num_processes):
            raise ValueError(f"EngineConfig.process_id must be in [0, num_processes={self.num_processes}), "
                             f"got {self.process_id!r}")
        if self.num_processes > 1 and not self.coordinator_address:
            raise ValueError("EngineConfig.coordinator_address (HOST:PORT) is needed with num_processes > 1")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"EngineConfig.seed must be an integer, got {self.seed!r}")
        for name in ("scan_layers", "stack_layer_weights", "cpu_reuse_freed_memory"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"EngineConfig.{name} must be a boolean or None, got {value!r}")
        for name in ("enable_prefix_caching", "enable_chunked_prefill", "interpret", "precompile",
                     "background_compile", "warmup", "prompt_scoring_bucket", "disable_hybrid_kv_cache_manager"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"EngineConfig.{name} must be a boolean, got {getattr(self, name)!r}")
        for name in ("token_buckets", "seq_buckets"):
            buckets = getattr(self, name)
            if buckets is None:
                continue
            buckets = tuple(buckets)
            object.__setattr__(self, name, buckets)
            if not buckets or any(isinstance(b, bool) or not isinstance(b, int) or b <= 0 for b in buckets):
                raise ValueError(f"EngineConfig.{name} must be positive integers, got {buckets!r}")
            if list(buckets) != sorted(set(buckets)):
                raise ValueError(f"EngineConfig.{name} must be strictly increasing, got {buckets!r}")
        object.__setattr__(self, "speculative_config", SpeculativeConfig.from_value(self.speculative_config))
        spec = self.speculative_config
        if spec is not None and spec.num_speculative_tokens >= self.max_num_batched_tokens:
            raise ValueError(f"speculative_config.num_speculative_tokens ({spec.num_speculative_tokens}) "
                             f"must be below max_num_batched_tokens ({self.max_num_batched_tokens})")
        self._check_disaggregation()
        check_lora_config(self)
        self._check_quantization()
        if self.token_buckets is not None and self.token_buckets[-1] < self.max_num_batched_tokens:
            raise ValueError(
                "EngineConfig.token_buckets: the largest bucket "
                f"({self.token_buckets[-1]}) must cover max_num_batched_tokens ({self.max_num_batched_tokens})"
            )
        if self.seq_buckets is not None and self.seq_buckets[-1] < self.max_num_seqs:
            raise ValueError(
                f"EngineConfig.seq_buckets: the largest bucket ({self.seq_buckets[-1]}) "
                f"must cover max_num_seqs ({self.max_num_seqs})"
            )

    def _check_disaggregation(self) -> None:
        object.__setattr__(self, "disaggregation", DisaggregationConfig.from_value(self.disaggregation))
        pd = self.disaggregation
        if pd is None:
            return
        if self.data_parallel_size != 1 or self.num_processes != 1:
            raise ValueError("EngineConfig.disaggregation runs one prefill and one decode pool in one process: "
                             "data_parallel_size and num_processes must be 1")
        if self.tensor_parallel_size not in (1, pd.prefill):
            raise ValueError(f"EngineConfig.tensor_parallel_size={self.tensor_parallel_size}: with "
                             f"disaggregation each pool's tensor-parallel size is its device count ({pd.prefill})")
        if self.speculative_config is not None:
            raise ValueError("EngineConfig.disaggregation does not support speculative_config yet")
        if not self.enable_prefix_caching:
            raise ValueError("EngineConfig.disaggregation needs enable_prefix_caching=True: the decode pool "
                             "admits the moved KV blocks as prefix-cache hits")
        if self.policy == "static" or self.kv_allocation != "paged":
            raise ValueError("EngineConfig.disaggregation needs policy fcfs or priority and kv_allocation paged")

    def _check_quantization(self) -> None:
        _choice("quantization", self.quantization, (*QUANTIZATIONS, "gguf"), allow_none=True)
        _choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        rows = self.quantization_activation_rows
        if rows is not None and (isinstance(rows, bool) or not isinstance(rows, int) or rows < 0):
            raise ValueError(f"EngineConfig.quantization_activation_rows must be a non-negative integer or None, "
                             f"got {rows!r}")
        if rows is not None and self.quantization in (None, "gguf"):
            raise ValueError("EngineConfig.quantization_activation_rows needs quantization (int8 or fp8); "
                             f"got {self.quantization!r} (gguf blocks are weight-only)")
        self._check_smoothing()
        if self.quantization == "gguf" and self.on_mesh:
            raise ValueError("EngineConfig.quantization='gguf' is not implemented on a mesh (tensor_parallel_size="
                             f"{self.tensor_parallel_size}, data_parallel_size={self.data_parallel_size}, "
                             f"num_processes={self.num_processes}): its block weights are placed on one device; "
                             "int8 and fp8 shard")
        # Tensor and data parallelism, multi-host meshes and disaggregation (each pool's engine
        # quantizes its own copy; the KV handover moves an 8-bit cache's scales with its values,
        # engine/disaggregation/kv_transfer.py) all serve int8 / fp8 weights and the 8-bit cache.
        if self.quantization == "gguf" and self.disaggregation is not None:
            raise ValueError("EngineConfig.quantization='gguf' is not implemented with disaggregation: its "
                             "block weights are placed on one device, each pool has its own mesh; int8 and fp8 are")

    def _check_smoothing(self) -> None:
        alpha = smoothing_alpha(self.quantization_smoothing)  # a bad value: ValueError by name
        if alpha is None:
            return
        name = f"EngineConfig.quantization_smoothing={self.quantization_smoothing!r}"
        if self.quantization in (None, "gguf"):
            raise ValueError(f"{name} needs quantization int8 or fp8 (it prepares weights for quantizing); "
                             f"got quantization={self.quantization!r}")
        if self.on_mesh:
            raise ValueError(f"{name} is not implemented on a mesh (tensor_parallel_size="
                             f"{self.tensor_parallel_size}, data_parallel_size={self.data_parallel_size}, "
                             f"num_processes={self.num_processes}): its calibration runs the float model on "
                             "one device; pass quantization_smoothing='off'")
        if self.enable_lora:
            raise ValueError(f"{name} is not implemented with enable_lora (an adapter's A matrix reads "
                             "the unsmoothed input of its product); pass quantization_smoothing='off'")

    @property
    def on_mesh(self) -> bool:
        """More than one device: tensor or data parallelism, or several processes."""
        return self.tensor_parallel_size * self.data_parallel_size * self.num_processes > 1

    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineConfig:
        """Like the constructor, but an unknown knob is a ValueError that names it."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown engine option(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**kwargs)


def resolve_max_model_len(config: EngineConfig, model_context: int) -> int:
    """max_model_len, or min(the model's context, 4096); longer than the model's context is an error."""
    max_model_len = config.max_model_len or min(model_context, 4096)
    if max_model_len > model_context:
        raise ValueError(f"EngineConfig.max_model_len ({max_model_len}) exceeds the model's "
                         f"context length ({model_context})")
    return max_model_len


def resolve_dtype(config: EngineConfig, platform: str) -> str:
    if config.dtype is not None:
        return config.dtype
    return "float32" if platform == "cpu" else "bfloat16"


def resolve_scan_layers(config: EngineConfig, platform: str) -> bool:
    """None picks the measured default (BUILD_NOTES.md, "Layers: scan or unrolled")."""
    if config.scan_layers is not None:
        return config.scan_layers
    return SCAN_LAYERS_DEFAULT.get(platform, True)


def resolve_layer_loop(config: EngineConfig, platform: str) -> str:
    """How the compiled step runs the layers (one of LAYER_LOOPS): "unrolled" without
    scan_layers; with it, a lax.scan over weights stacked on a layer axis ("stacked") or over the
    layer index with each layer's weights in its own buffers, picked by lax.switch ("switch";
    models/llama.py): stack_layer_weights, or the platform's default (STACK_LAYER_WEIGHTS)."""
    if not resolve_scan_layers(config, platform):
        return "unrolled"
    stack = config.stack_layer_weights
    if stack is None:
        stack = STACK_LAYER_WEIGHTS.get(platform, True)
    return "stacked" if stack else "switch"


# Per platform, from the scan-vs-unrolled measurements in BUILD_NOTES.md. The GPU runs its layers
# unrolled (BUILD_NOTES "Compiled for the targets", stop 44, read from compiles for an H200, no
# device timed): under a scan over stacked weights XLA:GPU copies each layer's weights out of the
# stack every step (a dynamic-slice fusion holding a memcpy: every weight read, written and read
# again), and under the switch scan each of a layer's four lax.switch products is a conditional
# thunk outside the CUDA graphs, whose branch index the host reads back (128 round trips a step
# for Llama-3-8B). Unrolled there is neither, at 2-4x the compile time (Llama-3-8B 2x, 70B 4x).
SCAN_LAYERS_DEFAULT = {"cpu": True, "gpu": False, "tpu": True}
# Under a scan over stacked weights XLA:CPU copies each layer's slice out before its dots (about a
# third of a one-row step on the default model, BUILD_NOTES "Engine step speed"), so on the CPU
# the scan keeps per-layer buffers; XLA:TPU reads a slice in place and keeps the stacked scan.
STACK_LAYER_WEIGHTS = {"cpu": False, "gpu": True, "tpu": True}
LAYER_LOOPS = ("unrolled", "stacked", "switch")
CPU_PRODUCT_FORMS = ("measured", "static", "weight_first", "plain")  # engine/step/product_forms.py
CPU_VECTOR_WIDTHS = ("auto", "256", "512")  # engine/step/cpu_compile.py
CPU_ATTENTION_KERNELS = ("auto", "native", "jnp")  # engine/core/builder.py rows_kernel
# Quantized weights (models/quant.py): the smallest product (rows) that also quantizes its
# activations, per platform. CPU, measured (BUILD_NOTES.md "Quantization"): XLA:CPU converts int8
# weights inside a one-row dot at the speed of reading them, but from a few rows on the converted
# product is several times slower than float32, while int8 x int8 -> int32 dots are fast.
# Accelerators: not measured (no device lent); weight-only everywhere (a decode step is
# weight-read-bound there, and weight-only keeps float activations).
# fp8 on the CPU: XLA:CPU has no fp8 dot (it converts), so weight-only at every size.
QUANT_ACTIVATION_ROWS = {("cpu", "int8"): 2}


def resolve_activation_rows(config: EngineConfig, platform: str) -> int | None:
    """quantization_activation_rows, or the platform's default (None: never; also without
    quantization)."""
    if config.quantization is None:
        return None
    if config.quantization_activation_rows is not None:
        return config.quantization_activation_rows
    return QUANT_ACTIVATION_ROWS.get((platform, config.quantization))


# SmoothQuant-style smoothing (models/smoothing.py) by default, per platform and quantization:
# where products of 2+ rows run int8 x int8 with one activation scale per row (the CPU), alpha 0.5
# halved the KL divergence from float32 on the default model (BUILD_NOTES.md "Activation scales").
QUANT_SMOOTHING = {("cpu", "int8"): 0.5}


def smoothing_alpha(value) -> float | None:
    """EngineConfig.quantization_smoothing as an alpha (None: "off" or unset), or a ValueError
    that names it."""
    if value is None or value == "off":
        return None
    try:
        alpha = float(value) if isinstance(value, str) else value
        from models.smoothing import check_alpha

        return check_alpha(alpha)
    except ValueError:
        raise ValueError(f"EngineConfig.quantization_smoothing must be an alpha in [0, 1] (e.g. 0.5), 'off' or "
                         f"None (the platform's default), got {value!r}") from None


def resolve_smoothing(config: EngineConfig, platform: str) -> float | None:
    """The smoothing alpha the engine applies, or None: quantization_smoothing, or where it is None
    the platform's default (QUANT_SMOOTHING) when some step's products quantize their activations
    (activation rows within max_num_batched_tokens) on one device without LoRA (a mesh or
    adapters keep unsmoothed weights by default; weight-only alone gains nothing from it)."""
    if config.quantization_smoothing is not None:
        return smoothing_alpha(config.quantization_smoothing)
    rows = resolve_activation_rows(config, platform)
    if config.on_mesh or config.enable_lora or rows is None or rows > config.max_num_batched_tokens:
        return None
    return QUANT_SMOOTHING.get((platform, config.quantization))


def _choice(name: str, value, choices, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if value not in choices:
        raise ValueError(f"EngineConfig.{name} must be one of {', '.join(choices)}, got {value!r}")


def _positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"EngineConfig.{name} must be a positive integer, got {value!r}")
