"""engine/step/host_memory.py: on the CPU, glibc keeps the memory a step frees for the next one.

The setting is process-wide, so the mechanism is checked in subprocesses: a 48 MiB block
(above glibc's largest dynamic mmap threshold, 32 MiB, like the default model's 42 MiB of
32-row temporaries) malloc'ed, written and freed ten times faults its pages in every time
without the setting, and once with it."""

import subprocess
import sys

import pytest

from engine.step import host_memory

_LOOP = """
import ctypes, resource, sys
from engine.step import host_memory
if sys.argv[1] == "on":
    print(host_memory.reuse_freed_memory(None, "cpu"), file=sys.stderr)
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
size = 48 << 20
faults = []
for _ in range(10):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    p = libc.malloc(size)
    ctypes.memset(p, 1, size)
    libc.free(p)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(sum(faults[1:]))
"""


def _later_faults(mode: str) -> int:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": "."}
    out = subprocess.run([sys.executable, "-c", _LOOP, mode], capture_output=True, text=True, timeout=120,
                         env=env, check=True)
    return int(out.stdout.strip())


@pytest.mark.skipif(host_memory._glibc() is None, reason="glibc's mallopt is what is tested")
def test_a_freed_large_block_is_reused_instead_of_faulted_in_again():
    pages = (48 << 20) // 4096
    assert _later_faults("off") >= 9 * pages * 0.9  # each of the 9 later rounds maps it afresh
    assert _later_faults("on") < pages  # the later rounds reuse the first round's pages


def test_off_and_other_platforms_change_nothing(monkeypatch):
    monkeypatch.setattr(host_memory, "_applied", None)
    monkeypatch.setattr(host_memory, "_glibc", lambda: pytest.fail("mallopt must not be reached"))
    assert host_memory.reuse_freed_memory(False, "cpu") == "off"
    assert host_memory.reuse_freed_memory(None, "tpu") == "not needed on tpu"
    assert host_memory.reuse_freed_memory(True, "gpu") == "not needed on gpu"
    monkeypatch.setattr(host_memory, "_applied", "glibc mmap and trim thresholds at 1024 MiB")
    assert "an earlier engine in this process set it" in host_memory.reuse_freed_memory(False, "cpu")


def test_the_environment_s_own_malloc_settings_win(monkeypatch):
    monkeypatch.setattr(host_memory, "_applied", None)
    monkeypatch.setattr(host_memory, "_glibc", lambda: pytest.fail("mallopt must not be reached"))
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=0")
    assert "environment" in host_memory.reuse_freed_memory(None, "cpu")


def test_without_glibc_none_goes_on_and_true_is_refused(monkeypatch):
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    for name in host_memory._ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(host_memory, "_glibc", lambda: None)
    monkeypatch.setattr(host_memory, "_applied", None)
    with pytest.raises(RuntimeError, match="cpu_reuse_freed_memory=True needs glibc"):
        host_memory.reuse_freed_memory(True, "cpu")
    assert host_memory.reuse_freed_memory(None, "cpu") == "not available (no glibc mallopt)"


def test_the_config_takes_only_a_boolean_or_none():
    from engine.config import EngineConfig

    with pytest.raises(ValueError, match="cpu_reuse_freed_memory must be a boolean or None"):
        EngineConfig(cpu_reuse_freed_memory="yes")
    assert EngineConfig(cpu_reuse_freed_memory=False).cpu_reuse_freed_memory is False
