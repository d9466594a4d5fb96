"""Load-test an OpenAI-compatible streaming endpoint (ours or another engine's) and report.

    python -m experiments.bench.serving --base_url=http://127.0.0.1:8000 --dataset=sharegpt \
        --num_prompts=200 --request_rate=4 --goodput="ttft:1000 itl_p95:50" \
        --result_json=experiments/results/bench.json

1. Build the workload (`experiments.lab.datasets`): prompts are tokenized with the default model's
   tokenizer (or `--tokenizer`), whatever the server, so two engines get identical requests.
2. Send it (`experiments.lab.load_client`): `--request_rate` with `--burstiness`, or
   `--max_concurrency`, or both; `--num_prompts` requests or `--duration_s` seconds; trace
   datasets keep their own arrival times unless `--notrace_arrivals`.
3. Compute the metrics (`experiments.lab.metrics`, definitions there), print a table in the layout of
   `vllm bench serve`, and write the result (config, metrics, per-request summary) as JSON.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import time
from collections.abc import Mapping, Sequence

from absl import app, flags

from experiments.lab import datasets, load_client, metrics

_BASE_URL = flags.DEFINE_string("base_url", "http://127.0.0.1:8000", "Server root URL.")
_ENDPOINT = flags.DEFINE_enum("endpoint", "completions", ["completions", "chat"], "API to call.")
_MODEL = flags.DEFINE_string("model", "", "Model name sent; empty: the first of /v1/models.")
_TOKENIZER = flags.DEFINE_string("tokenizer", "", "Tokenizer path; empty: the default model's.")
_DATASET = flags.DEFINE_enum(
    "dataset", "random", ["sharegpt", "trace", "random", "shared-prefix"], "Workload.")
_DATASET_PATH = flags.DEFINE_string("dataset_path", "", "ShareGPT JSON; empty: packaged file.")
_TRACE_PATH = flags.DEFINE_string("trace_path", "", "Azure .csv or Mooncake .jsonl trace.")
_NUM_PROMPTS = flags.DEFINE_integer("num_prompts", 100, "Requests to send (or samples to cycle).")
_DURATION_S = flags.DEFINE_float("duration_s", None, "Stop sending after this many seconds.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed for sampling prompts and arrivals.")
_TIME_SCALE = flags.DEFINE_float("time_scale", 1.0, "Trace arrival offsets are multiplied by this.")
_LENGTH_SCALE = flags.DEFINE_float("length_scale", 1.0, "Trace lengths are multiplied by this.")
_MAX_PROMPT_LEN = flags.DEFINE_integer(
    "max_prompt_len", None, "ShareGPT: drop longer prompts (default 1024); traces: clip.")
_MAX_OUTPUT_LEN = flags.DEFINE_integer("max_output_len", None, "Clip expected output lengths.")
_SHAREGPT_MAX_TOTAL_LEN = flags.DEFINE_integer(
    "sharegpt_max_total_len", 2048, "ShareGPT: drop pairs with prompt + output above this.")
_RANDOM_INPUT_LEN = flags.DEFINE_integer("random_input_len", 128, "random: prompt tokens.")
_RANDOM_OUTPUT_LEN = flags.DEFINE_integer("random_output_len", 64, "random: output tokens.")
_RANDOM_RANGE_RATIO = flags.DEFINE_float(
    "random_range_ratio", 0.0, "random: lengths uniform in len * [1 - r, 1 + r].")
_NUM_PREFIXES = flags.DEFINE_integer("num_prefixes", 4, "shared-prefix: system prompts.")
_QUESTIONS_PER_PREFIX = flags.DEFINE_integer("questions_per_prefix", 8, "shared-prefix: M.")
_PREFIX_LEN = flags.DEFINE_integer("prefix_len", 256, "shared-prefix: system prompt tokens.")
_QUESTION_LEN = flags.DEFINE_integer("question_len", 32, "shared-prefix: question tokens.")
_SHARED_OUTPUT_LEN = flags.DEFINE_integer("shared_output_len", 64, "shared-prefix: output tokens.")
_REQUEST_RATE = flags.DEFINE_float("request_rate", math.inf, "Requests per second; inf = at once.")
_BURSTINESS = flags.DEFINE_float("burstiness", 1.0, "Gamma shape of arrival gaps; 1 = Poisson.")
_MAX_CONCURRENCY = flags.DEFINE_integer("max_concurrency", None, "Cap on requests in flight.")
_TRACE_ARRIVALS = flags.DEFINE_bool("trace_arrivals", True, "trace: send at the trace's times.")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", None, "Override every request's max_tokens.")
_IGNORE_EOS = flags.DEFINE_bool("ignore_eos", False, "Send ignore_eos (vLLM/SGLang extension).")
_TEMPERATURE = flags.DEFINE_float("temperature", None, "Sampling override.")
_TOP_P = flags.DEFINE_float("top_p", None, "Sampling override.")
_TOP_K = flags.DEFINE_integer("top_k", None, "Sampling override.")
_EXTRA_BODY = flags.DEFINE_string("extra_body", "", "JSON object merged into every request.")
_GOODPUT = flags.DEFINE_string(
    "goodput", "", 'SLOs in ms, e.g. "ttft:1000 tpot:50 e2el:10000 itl_p95:50".')
_RESULT_JSON = flags.DEFINE_string("result_json", "", "Write the result here (JSON).")
_LABEL = flags.DEFINE_string("label", "", "Free text stored with the result (e.g. engine name).")
_DISABLE_TQDM = flags.DEFINE_bool("disable_tqdm", False, "No progress bar.")


@dataclasses.dataclass
class BenchResult:
    metrics: metrics.BenchmarkMetrics
    records: list[metrics.RequestRecord]
    config: dict  # what was run: client config, dataset options, label

    def to_dict(self) -> dict:
        return {
            "config": self.config,
            "metrics": self.metrics.to_dict(),
            "requests": [_request_summary(r) for r in self.records],
        }


def _request_summary(record: metrics.RequestRecord) -> dict:
    summary = {
        "success": record.success,
        "prompt_len": record.prompt_len,
        "output_tokens": record.output_tokens,
        "error": record.error,
    }
    if record.success:
        summary.update({f"{k}_ms": v for k, v in metrics.request_values_ms(record).items()})
    return summary


def benchmark(
    samples: Sequence[datasets.SampleRequest], config: load_client.ClientConfig,
    slos_ms: Mapping[str, float] | None = None, extra_config: Mapping | None = None,
) -> BenchResult:
    run = load_client.run(samples, config)
    result_metrics = metrics.compute_metrics(run.records, run.duration_s, slos_ms)
    config_dict = {k: v for k, v in dataclasses.asdict(config).items() if k != "sampling"}
    config_dict["sampling"] = dict(config.sampling)
    config_dict["request_rate"] = _json_float(config.request_rate)
    config_dict.update(extra_config or {})
    return BenchResult(result_metrics, run.records, config_dict)


def _json_float(x: float) -> float | str:
    return x if math.isfinite(x) else str(x)


def write_json(path: str | pathlib.Path, obj) -> None:
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1) + "\n")


# ---------------------------------------------------------------- flags -> configs (entry points)


def dataset_options_from_flags(fv: flags.FlagValues, **overrides) -> datasets.DatasetOptions:
    return datasets.DatasetOptions(**{
        "dataset": fv.dataset,
        "num_prompts": fv.num_prompts,
        "seed": fv.seed,
        "dataset_path": fv.dataset_path,
        "trace_path": fv.trace_path,
        "time_scale": fv.time_scale,
        "length_scale": fv.length_scale,
        "max_prompt_len": fv.max_prompt_len,
        "max_output_len": fv.max_output_len,
        "sharegpt_max_total_len": fv.sharegpt_max_total_len,
        "random_input_len": fv.random_input_len,
        "random_output_len": fv.random_output_len,
        "random_range_ratio": fv.random_range_ratio,
        "num_prefixes": fv.num_prefixes,
        "questions_per_prefix": fv.questions_per_prefix,
        "prefix_len": fv.prefix_len,
        "question_len": fv.question_len,
        "output_len": fv.shared_output_len,
        **overrides,
    })


def client_config_from_flags(fv: flags.FlagValues, model: str, **overrides) -> load_client.ClientConfig:
    sampling = {k: getattr(fv, k) for k in ("temperature", "top_p", "top_k")
                if getattr(fv, k) is not None}
    if fv.extra_body:
        sampling.update(json.loads(fv.extra_body))
    return load_client.ClientConfig(**{
        "base_url": fv.base_url,
        "model": model,
        "endpoint": fv.endpoint,
        "request_rate": fv.request_rate,
        "burstiness": fv.burstiness,
        "max_concurrency": fv.max_concurrency,
        "use_trace_arrivals": fv.dataset == "trace" and fv.trace_arrivals,
        "num_requests": fv.num_prompts if fv.duration_s is None else None,
        "duration_s": fv.duration_s,
        "max_tokens": fv.max_tokens,
        "ignore_eos": fv.ignore_eos,
        "sampling": sampling,
        "seed": fv.seed,
        "show_progress": not fv.disable_tqdm,
        **overrides,
    })


def tokenizer_from_flags(fv: flags.FlagValues) -> datasets.Tokenizer:
    if not fv.tokenizer:
        return datasets.default_tokenizer()
    from text.tokenizer import load_tokenizer

    return load_tokenizer(fv.tokenizer)


def main(argv: Sequence[str]) -> None:
    del argv
    fv = flags.FLAGS
    slos_ms = metrics.parse_slos(fv.goodput) if fv.goodput else None
    model = fv.model or load_client.first_model_id(fv.base_url)
    options = dataset_options_from_flags(fv)
    t0 = time.perf_counter()
    samples = datasets.build_samples(options, tokenizer_from_flags(fv))
    print(f"{len(samples)} {options.dataset} samples built in {time.perf_counter() - t0:.1f} s")
    config = client_config_from_flags(fv, model)
    extra = {"label": fv.label, "dataset_options": dataclasses.asdict(options)}
    result = benchmark(samples, config, slos_ms, extra)
    print(metrics.format_table(result.metrics))
    if fv.result_json:
        write_json(fv.result_json, result.to_dict())
        print(f"wrote {fv.result_json}")


if __name__ == "__main__":
    app.run(main)
