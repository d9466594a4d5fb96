"""Starting real server processes for tests.

As a script, `python tests/entrypoints/server_launcher.py [serve flags] --fake_step_sleep=S` runs
entrypoints.openai.serve's main (the real flags, app and server) around the fake engine of
fake_engine.py; the test double stays out of library code because only this file hands serve.main
an engine factory. `--fake_tokenizer=default` swaps the fake tokenizer for the default model's
real one (the fake model still computes its next token from the ids).

Imported (tests put this folder on sys.path), `ServerProcess` starts either that fake server or
the real `python -m entrypoints.openai.serve` on a free loopback port and stops it with SIGTERM.
"""

import functools
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parents[2]
_READY = re.compile(r"jaxserve: serving .* on (http://\S+)")


class ServerProcess:
    """A server subprocess on 127.0.0.1 with a free port; `url` is its base URL once started."""

    def __init__(self, *flags: str, fake: bool = True, startup_timeout: float = 60.0):
        entry = [str(pathlib.Path(__file__).resolve())] if fake else ["-m", "entrypoints.openai.serve"]
        self.args = [sys.executable, *entry, "--host=127.0.0.1", "--port=0", *flags]
        self.startup_timeout = startup_timeout
        self.lines: list[str] = []  # everything the process printed
        self.url: str | None = None
        self.proc: subprocess.Popen | None = None

    def start(self) -> "ServerProcess":
        env = dict(os.environ, PYTHONUNBUFFERED="1", JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
        self.proc = subprocess.Popen(self.args, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        ready = threading.Event()
        threading.Thread(target=self._drain, args=(ready,), daemon=True).start()
        if not ready.wait(self.startup_timeout) or self.url is None:
            self.kill()
            raise RuntimeError("server did not start:\n" + "".join(self.lines[-50:]))
        return self

    def _drain(self, ready: threading.Event) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            match = _READY.search(line)
            if match and self.url is None:
                self.url = match.group(1)
                ready.set()
        ready.set()  # the process ended

    def terminate(self, timeout: float = 30.0) -> int:
        """SIGTERM, then wait; returns the exit code."""
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, predicate, timeout: float, interval: float = 0.02):
        """Polls predicate() until it returns something truthy; returns that (or the last value)."""
        deadline = time.monotonic() + timeout
        while True:
            value = predicate()
            if value or time.monotonic() > deadline:
                return value
            time.sleep(interval)


def http(method: str, url: str, body: bytes | str | dict | None = None, headers: dict | None = None):
    """One plain HTTP request; returns (status, headers, body text) for any status."""
    if isinstance(body, dict):
        body = json.dumps(body)
    if isinstance(body, str):
        body = body.encode()
    request = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.headers, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.headers, error.read().decode()


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {sample name with labels: value}."""
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def _main() -> None:
    sys.path.insert(0, str(ROOT))
    from absl import app, flags
    from fake_engine import FakeLLMEngine  # this file's folder is on sys.path

    from entrypoints.openai import serve

    flags.DEFINE_float("fake_step_sleep", 0.01, "Seconds each fake engine step sleeps.")
    flags.DEFINE_string("fake_tokenizer", None, "'default': the default model's tokenizer instead of the fake one.")

    def factory(config):
        engine = FakeLLMEngine(config, step_sleep=flags.FLAGS.fake_step_sleep)
        if flags.FLAGS.fake_tokenizer == "default":
            from models.default_model import default_model_path
            from text.tokenizer import load_tokenizer

            engine.tokenizer = load_tokenizer(default_model_path())
        return engine

    app.run(functools.partial(serve.main, engine_factory=factory))


if __name__ == "__main__":
    _main()
