"""`--speculative_config` on the server: a JSON object, bad keys or values refused by name."""

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("value, message", [
    ('{"method": "bogus"}', "speculative_config.method"),
    ('{"method": "draft_head"}', "speculative_config.model"),
    ("ngram", "must be a JSON object"),
])
def test_bad_speculative_config_flag_is_refused_by_name(value, message):
    proc = subprocess.run([sys.executable, "-m", "entrypoints.openai.serve", f"--speculative_config={value}"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode != 0 and message in proc.stderr + proc.stdout
