"""Cold start of the server: seconds from launch to a healthy /health, with empty caches.

    python -m experiments.bench.cold_start [--runs=1 --serve_flags="--max_num_seqs=32"]

Each run starts `python -m entrypoints.openai.serve --model=default --port=0` (the flags `make
serve` passes, plus --serve_flags) with a fresh, empty compilation cache and weights cache (so
the GGUF is converted and every bucket compiled, as on a new machine), polls /health every 0.2 s
and reports when the server printed its address (ready) and when /health first answered 200
(healthy), then stops it with SIGTERM. The server's own start-up lines (weights load, bucket
compilation) are kept in the JSON for a look at where the time went.
"""

from __future__ import annotations

import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

from absl import app, flags

_RUNS = flags.DEFINE_integer("runs", 1, "cold starts to make (the median is reported)")
_MODEL = flags.DEFINE_string("model", "default", "model spec")
_SERVE_FLAGS = flags.DEFINE_string("serve_flags", "--background_compile",
                                   "extra flags for entrypoints.openai.serve (default: make serve's)")
_TIMEOUT = flags.DEFINE_float("timeout_s", 600.0, "give up on a start after this long")
_RESULT_JSON = flags.DEFINE_string("result_json", "", "where to write the runs (default: none)")

_READY = re.compile(r"jaxserve: serving .* on (http://\S+)")
_ALL_COMPILED = re.compile(r"jaxserve: (\d+) of (\d+) buckets compiled")


def cold_start(model: str, extra_flags: list[str], timeout_s: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="jaxserve-cold-") as tmp:
        env = dict(os.environ, PYTHONUNBUFFERED="1", JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"),
                   JAXSERVE_COMPILATION_CACHE=os.path.join(tmp, "jax"))
        args = [sys.executable, "-m", "entrypoints.openai.serve", f"--model={model}",
                "--host=127.0.0.1", "--port=0", f"--weights_cache_dir={os.path.join(tmp, 'weights')}",
                f"--compilation_cache_dir={os.path.join(tmp, 'jax')}", *extra_flags]
        start = time.perf_counter()
        proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines: list[tuple[float, str]] = []
        url: list[str] = []
        ready = threading.Event()

        def drain():
            for line in proc.stdout:
                lines.append((time.perf_counter() - start, line.rstrip()))
                match = _READY.search(line)
                if match and not url:
                    url.append(match.group(1))
                    ready.set()
            ready.set()

        threading.Thread(target=drain, daemon=True).start()
        try:
            if not ready.wait(timeout_s) or not url:
                raise RuntimeError("server did not start:\n" + "\n".join(t for _, t in lines[-30:]))
            ready_s = time.perf_counter() - start
            while True:
                try:
                    with urllib.request.urlopen(url[0] + "/health", timeout=5) as r:
                        if r.status == 200:
                            break
                except OSError:
                    pass
                if time.perf_counter() - start > timeout_s:
                    raise RuntimeError("server never became healthy")
                time.sleep(0.2)
            healthy_s = time.perf_counter() - start
            # With --background_compile, also when the last bucket is compiled (steady state).
            compiled_s = None
            if "--background_compile" in extra_flags:
                while compiled_s is None and time.perf_counter() - start < timeout_s and proc.poll() is None:
                    compiled_s = next((t for t, line in list(lines) if _ALL_COMPILED.search(line)), None)
                    time.sleep(0.2)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
    return {"ready_s": ready_s, "healthy_s": healthy_s, "all_compiled_s": compiled_s,
            "log": [f"{t:7.2f}s {text}" for t, text in lines]}


def main(argv) -> None:
    del argv
    extra = _SERVE_FLAGS.value.split() if _SERVE_FLAGS.value else []
    runs = []
    for i in range(_RUNS.value):
        r = cold_start(_MODEL.value, extra, _TIMEOUT.value)
        runs.append(r)
        compiled = "" if r["all_compiled_s"] is None else f", every bucket compiled {r['all_compiled_s']:.1f} s"
        print(f"run {i + 1}: ready {r['ready_s']:.1f} s, healthy {r['healthy_s']:.1f} s{compiled}")
    median = statistics.median(r["healthy_s"] for r in runs)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"cold start to a healthy /health: median {median:.1f} s over {len(runs)} run(s) "
          f"(load average {load:.1f})")
    if _RESULT_JSON.value:
        with open(_RESULT_JSON.value, "w") as f:
            json.dump({"model": _MODEL.value, "serve_flags": extra, "median_healthy_s": median,
                       "load_average": load, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    app.run(main)
