"""The decode pool of prefill/decode disaggregation (pd_engine.py) in another process:
`RemoteDecodePool`, the leader's handle, and `python -m engine.disaggregation.decode_pool
--listen=HOST:PORT`, the command that starts that process (its loop is decode_process.py). The
pool in this process is `DecodePool` (local_pool.py); the address and key are in connection.py.

Both offer PDEngine the same calls: `hand_over(request_id, hashes, k, v, *add_args)` registers and
pins the request's moved prompt blocks (KVCacheManager.import_blocks), writes those the pool did
not hold from the gathered bucket and queues the request (`add_request(..., resume=...)`);
`step()` runs the decode engine and drops the pins of requests it has admitted, finished or
aborted; `num_pending` counts the requests moved and not yet admitted (the transfer queue).

Across processes the leader (the process with the prefill pool and the HTTP server) keeps a
`multiprocessing.connection` to the decode process for the calls (pickled arguments, outputs and
stats) and a `jax.experimental.transfer` server from which the decode process pulls each gathered
bucket straight onto its own devices' sharding. Messages are processed in order, all of those
waiting before each step. The decode process steps on its own while it has work (it does not
wait for the leader to ask): its streams keep their pace even when the leader's core is busy
with prefill, and a `step` call returns every output made since the last one (the newest per
request: outputs are cumulative), waiting for the step in flight only when there is none.
Nothing the leader sends besides `step` waits for an answer, so the leader never waits for a
decode step it is not collecting: a handover is an `offer` (hashes and the request), which the
decode process accepts between its steps (registering and pinning the blocks) and queues the
request at once. When it lacks a block, the next `step` answer asks for the bucket, the leader
offers it to the transfer server and sends `write`, and the decode process pulls it on a thread while
its running requests keep stepping, then scatters it between two steps. Until every asked bucket
has landed its scheduler admits nothing, since the blocks are in its prefix cache already (an
admission could read them; running requests never do). The leader sends the bucket of every
accepted offer, even of a request aborted meanwhile (whose pins stay until it lands). A handover
that fails there comes back as the request's failed output. A decode process that dies (or
whose connection breaks, or that answers no call for CALL_TIMEOUT_S) raises EngineDeadError from
the call that finds it and sets `dead_reason`; PDEngine then degrades (pd_engine.py: the prefill
pool decodes everything itself) and calls `abandon`, which drops what was kept for the pulls.
"""

from __future__ import annotations

import itertools
import threading
import time

from engine.core.engine_stats import EngineDeadError
from engine.disaggregation.connection import authkey, split_address
from scheduler import block_pool

CALL_TIMEOUT_S = 120.0  # a decode process that answers no call for this long is dead
CONNECT_TIMEOUT_S = 60.0  # how long the leader waits for the decode process to listen


class RemoteDecodePool:
    """The leader's handle on a decode pool in another process (see the module docstring)."""

    def __init__(self, address: str, pool_config, buckets: tuple[int, ...], source_runner):
        from multiprocessing.connection import Client

        import jax
        from jax.experimental import transfer

        host, port = split_address(address)
        self.address = address
        deadline = time.monotonic() + CONNECT_TIMEOUT_S
        while True:  # the decode process may still be starting
            try:
                self._conn = Client((host, port), authkey=authkey())
                break
            except OSError as exc:
                if time.monotonic() > deadline:
                    raise ValueError(f"EngineConfig.disaggregation.decode_address={address}: no decode pool "
                                     f"answered in {CONNECT_TIMEOUT_S:.0f} s ({exc}); start `python -m "
                                     f"engine.disaggregation.decode_pool --listen={address}` there") from None
                time.sleep(0.2)
        client = next(iter(jax.tree.leaves(source_runner.kv_cache)[0].devices())).client  # (a shared set: never mutate it)
        self._server = transfer.start_transfer_server(client, f"{host}:0", [f"{host}:0"])
        self._lock = threading.Lock()
        self._uuids = itertools.count(1)
        self._inflight: dict[int, object] = {}  # gathered arrays until the decode process pulled them
        self.dead_reason: str | None = None
        self._unfinished: set[str] = set()
        self._pinned: set[str] = set()  # moved and not admitted, as of the last step
        self._offers: dict[str, tuple] = {}  # offered buckets the decode process has not answered for
        self.pull_seconds, self.num_pulled, self.num_fallbacks = 0.0, 0, 0
        self._stats = None
        self.num_blocks = self._call("start", pool_config, buckets, self._server.address(), block_pool.ROOT_BLOCK_HASH)

    def _send(self, *message) -> None:
        try:
            with self._lock:
                self._conn.send(message)
        except (OSError, EOFError) as exc:
            self._die(exc)

    def _call(self, *message):
        try:
            with self._lock:
                self._conn.send(message)
                if not self._conn.poll(CALL_TIMEOUT_S):
                    raise TimeoutError(f"no answer to {message[0]!r} in {CALL_TIMEOUT_S:.0f} s")
                status, value = self._conn.recv()
        except (OSError, EOFError, TimeoutError) as exc:
            self._die(exc)
        if status == "error":
            exc_type, text = value
            raise (ValueError if exc_type == "ValueError" else RuntimeError)(text)
        return value

    def _die(self, exc: Exception):
        self.dead_reason = f"the decode pool process at {self.address} is gone: {type(exc).__name__}: {exc}"
        raise EngineDeadError(self.dead_reason) from exc

    def last_stats(self):
        """The snapshot that came with the last step, without a call (None before the first)."""
        return self._stats

    def abandon(self) -> None:
        """The leader stops using this pool (it is lost): the buckets held for its pulls and every
        record of its requests go, and the connection is closed (a live process then exits)."""
        self._inflight.clear()
        self._offers.clear()
        self._unfinished.clear()
        self._pinned.clear()
        try:
            with self._lock:
                self._conn.close()
        except OSError:
            pass

    @property
    def num_pending(self) -> int:
        return len(self._pinned | self._offers.keys())

    def is_pinned(self, request_id: str) -> bool:
        return request_id in self._pinned or request_id in self._offers

    def has_unfinished_requests(self) -> bool:
        return bool(self._unfinished or self._offers)  # an offer's answer is still to come

    def hand_over(self, request_id: str, hashes: list[int], k, v, *add_args, **add_kwargs) -> None:
        """Sends the offer and returns: whether the decode process needs the bucket (and so
        whether it was full) comes back with a later step."""
        add_kwargs.pop("grammar", None)  # compiled there again from the params (an LRU hit after the first)
        if k is not None:
            self._offers[request_id] = (k, v)
        self._unfinished.add(request_id)
        self._send("offer", request_id, hashes, add_args, add_kwargs)

    def abort_request(self, request_id: str) -> bool:
        """Its offer stays: if the decode process took the blocks, their bucket must still land."""
        self._unfinished.discard(request_id)
        self._send("abort", request_id)
        return True

    def step(self) -> list:
        from engine.disaggregation.kv_transfer import bucket_of, moved_leaves

        (outputs, pinned, (self.pull_seconds, self.num_pulled), pulled, self._stats, accepted,
         self.num_fallbacks) = self._call("step")
        for uuid in pulled:
            self._inflight.pop(uuid, None)
        for request_id, wanted in accepted:
            kv = self._offers.pop(request_id, None)  # (None: no block to offer)
            if wanted:  # also for a request aborted since: its blocks are registered there
                uuid = next(self._uuids)
                self._inflight[uuid] = kv
                self._server.await_pull(uuid, moved_leaves(kv))
                self._send("write", uuid, request_id, bucket_of(kv))
        self._pinned = set(pinned)
        for out in outputs:
            if out.finished:
                self._unfinished.discard(out.request_id)
        return outputs

    def get_stats(self):
        """The snapshot that came with the last step (no call while a step is in flight)."""
        if self._stats is None:
            self._stats = self._call("stats")
        return self._stats

    def reconfigure_scheduler(self, **changes):
        self._stats = None
        return self._call("reconfigure", changes)

    def close(self) -> None:
        try:
            self._send("close")
        except EngineDeadError:
            pass


def main(argv) -> None:
    from absl import flags

    from engine.disaggregation.decode_process import serve

    del argv
    serve(flags.FLAGS.listen)


if __name__ == "__main__":
    from absl import app, flags

    flags.DEFINE_string("listen", "127.0.0.1:9555", "HOST:PORT the leader's PDEngine connects to "
                        "(EngineConfig.disaggregation decode_address); loopback by default")
    app.run(main)
