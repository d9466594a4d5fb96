"""The decode process of tests/engine/test_disaggregation_process.py's two-process test: the real entry
point (`python -m engine.disaggregation.decode_pool --listen=HOST:PORT`, run with runpy), which
the test can catch in the middle of a transfer and of decoding, to kill it there.

While the file named by $HANG_PULLS_FILE exists, each pull of a gathered bucket from the leader
prints "PULLING <uuid>" and never returns (the test kills the process with SIGKILL), and each
decode step takes 50 ms longer (so the requests decoding there are still decoding when the
kill comes, however fast the machine); before that, everything runs as usual.
"""

import os
import runpy
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from jax.experimental import transfer  # noqa: E402

from engine.core.llm_engine import LLMEngine  # noqa: E402

HANG_FILE = os.environ["HANG_PULLS_FILE"]
_start_transfer_server, _step = transfer.start_transfer_server, LLMEngine.step


class _Connection:
    def __init__(self, connection):
        self._connection = connection

    def pull(self, uuid, specs):
        if os.path.exists(HANG_FILE):
            print(f"PULLING {uuid}", flush=True)
            time.sleep(3600)  # until SIGKILL
        return self._connection.pull(uuid, specs)


class _Server:
    def __init__(self, server):
        self._server = server

    def connect(self, address):
        return _Connection(self._server.connect(address))

    def __getattr__(self, name):
        return getattr(self._server, name)


def _slow_step(self):
    if os.path.exists(HANG_FILE):
        time.sleep(0.05)
    return _step(self)


transfer.start_transfer_server = lambda *args, **kwargs: _Server(_start_transfer_server(*args, **kwargs))
LLMEngine.step = _slow_step
runpy.run_module("engine.disaggregation.decode_pool", run_name="__main__", alter_sys=True)
