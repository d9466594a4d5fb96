"""Test-only launcher: `python tests/engine/server_launcher.py [engine.serve flags] --fake_step_sleep=S`
runs engine.serve's main (the real flags, app and server) around the fake engine of fake_engine.py.

This keeps the test double out of library code: serve.main accepts an engine factory, and only this
file passes one.
"""

import functools
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # the repository root

from absl import app, flags  # noqa: E402

from engine import serve  # noqa: E402
from fake_engine import FakeLLMEngine  # noqa: E402  (this file's folder is on sys.path)

flags.DEFINE_float("fake_step_sleep", 0.01, "Seconds each fake engine step sleeps.")


def _factory(config):
    return FakeLLMEngine(config, step_sleep=flags.FLAGS.fake_step_sleep)


if __name__ == "__main__":
    app.run(functools.partial(serve.main, engine_factory=_factory))
