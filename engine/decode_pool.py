"""The decode pool of prefill/decode disaggregation (engine/pd_engine.py): in this process
(`DecodePool`) or in another one (`RemoteDecodePool`, served by `python -m engine.decode_pool`).

Both offer PDEngine the same calls: `accept(request_id, hashes)` registers and pins blocks for a
request's moved prompt blocks (KVCacheManager.import_blocks) and says which ones to write,
`write(dest_ids, k, v)` lands a gathered bucket of blocks, `add_request(..., resume=...)` queues
the request, `step()` runs the decode engine and drops the pins of requests it has admitted,
finished or aborted; `num_pending` counts the requests still pinned (the transfer queue).

Across processes the leader (the process with the prefill pool and the HTTP server) keeps a
`multiprocessing.connection` to the decode process for the calls (pickled arguments, outputs and
stats) and a `jax.experimental.transfer` server from which the decode process pulls each gathered
bucket straight onto its own devices' sharding. Messages are processed in order, all of those
waiting before each step, so a request's blocks always land before its first step. The decode
process steps on its own while it has work (it does not wait for the leader to ask): its
streams keep their pace even when the leader's core is busy with prefill, and a `step` call
returns every output made since the last one (the newest per request: outputs are cumulative),
waiting for the step in flight only when there is none.
"""

from __future__ import annotations

import itertools
import os
import threading
import time

from engine.engine_stats import EngineDeadError

AUTHKEY_ENV = "JAXSERVE_POOL_AUTHKEY"  # shared secret of the two processes (default: a constant)
CALL_TIMEOUT_S = 120.0  # a decode process that answers no call for this long is dead
CONNECT_TIMEOUT_S = 60.0  # how long the leader waits for the decode process to listen


class DecodePool:
    def __init__(self, engine, scatter):
        self.engine, self.scatter = engine, scatter
        self._pinned: dict[str, list[int]] = {}
        self._n: dict[str, int] = {}
        self.pull_seconds, self.num_pulled = 0.0, 0  # remote pulls (timed where they land)
        self.num_blocks = scatter.num_blocks  # the cache's blocks; an id this large is dropped

    @property
    def dead_reason(self) -> str | None:
        return self.engine.dead_reason

    @property
    def num_pending(self) -> int:
        return len(self._pinned)

    def is_pinned(self, request_id: str) -> bool:
        return request_id in self._pinned

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests()

    def accept(self, request_id: str, hashes: list[int]) -> list[tuple[int, int]] | None:
        imported = self.engine.scheduler.kv_cache_manager.import_blocks(hashes)
        if imported is None:
            return None
        self._pinned[request_id], to_write = imported
        return to_write

    def write(self, dest_ids, k, v) -> None:
        self.scatter.write(dest_ids, k, v)

    def add_request(self, request_id: str, prompt_ids, params, arrival, **kwargs) -> None:
        try:
            self.engine.add_request(request_id, prompt_ids, params, arrival, **kwargs)
        except Exception:
            self._unpin(request_id)
            raise
        self._n[request_id] = params.n

    def abort_request(self, request_id: str) -> bool:
        self._forget(request_id)
        return self.engine.abort_request(request_id)

    def step(self) -> list:
        outputs = self.engine.step() if self.engine.has_unfinished_requests() else []
        for out in outputs:
            if out.finished:
                self._forget(out.request_id)
        for request_id in [r for r in self._pinned if self._admitted(r)]:
            self._unpin(request_id)
        return outputs

    def get_stats(self):
        return self.engine.get_stats()

    def reconfigure_scheduler(self, **changes):
        if self._pinned:
            raise ValueError("reconfigure_scheduler needs an idle engine: KV transfers are pending")
        return self.engine.reconfigure_scheduler(**changes)

    def _admitted(self, request_id: str) -> bool:
        """Every live sequence of the request is admitted (its table holds the moved blocks)."""
        get, n = self.engine.scheduler.get_request, self._n.get(request_id, 1)
        seqs = [get(request_id)] if n == 1 else [get(f"{request_id}#{i}") for i in range(n)]
        return all(s is None or s.num_computed_tokens > 0 for s in seqs)

    def _forget(self, request_id: str) -> None:
        self._n.pop(request_id, None)
        self._unpin(request_id)

    def _unpin(self, request_id: str) -> None:
        pinned = self._pinned.pop(request_id, None)
        if pinned:
            self.engine.scheduler.kv_cache_manager.release(pinned)


def _authkey() -> bytes:
    return os.environ.get(AUTHKEY_ENV, "jaxserve-decode-pool").encode()


def _split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"EngineConfig.disaggregation.decode_address must be HOST:PORT, got {address!r}")
    return host, int(port)


class RemoteDecodePool:
    """The leader's handle on a decode pool in another process (see the module docstring)."""

    def __init__(self, address: str, pool_config, buckets: tuple[int, ...], source_runner):
        from multiprocessing.connection import Client

        from jax.experimental import transfer

        host, port = _split_address(address)
        self.address = address
        deadline = time.monotonic() + CONNECT_TIMEOUT_S
        while True:  # the decode process may still be starting
            try:
                self._conn = Client((host, port), authkey=_authkey())
                break
            except OSError as exc:
                if time.monotonic() > deadline:
                    raise ValueError(f"EngineConfig.disaggregation.decode_address={address}: no decode pool "
                                     f"answered in {CONNECT_TIMEOUT_S:.0f} s ({exc}); start `python -m "
                                     f"engine.decode_pool --listen={address}` there") from None
                time.sleep(0.2)
        client = next(iter(source_runner.kv_cache[0].devices())).client  # (a shared set: never mutate it)
        self._server = transfer.start_transfer_server(client, f"{host}:0", [f"{host}:0"])
        self._lock = threading.Lock()
        self._uuids = itertools.count(1)
        self._inflight: dict[int, object] = {}  # gathered arrays until the decode process pulled them
        self.dead_reason: str | None = None
        self._unfinished: set[str] = set()
        self.num_pending, self._pinned = 0, set()
        self.pull_seconds, self.num_pulled = 0.0, 0
        self._stats = None
        self.num_blocks = self._call("start", pool_config, buckets, self._server.address())

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

    def is_pinned(self, request_id: str) -> bool:
        return request_id in self._pinned

    def has_unfinished_requests(self) -> bool:
        return bool(self._unfinished)

    def accept(self, request_id: str, hashes: list[int]):
        to_write = self._call("accept", request_id, hashes)
        if to_write is not None:
            self._pinned.add(request_id)
        return to_write

    def write(self, dest_ids, k, v) -> None:
        uuid = next(self._uuids)
        self._inflight[uuid] = (k, v)
        self._server.await_pull(uuid, [k, v])
        self._send("write", uuid, list(map(int, dest_ids)), k.shape[1])

    def add_request(self, request_id: str, *args, **kwargs) -> None:
        kwargs.pop("grammar", None)  # compiled there again from the params (an LRU hit after the first)
        self._call("add", request_id, args, kwargs)
        self._unfinished.add(request_id)

    def abort_request(self, request_id: str) -> bool:
        self._unfinished.discard(request_id)
        self._pinned.discard(request_id)
        return self._call("abort", request_id)

    def step(self) -> list:
        outputs, pinned, (self.pull_seconds, self.num_pulled), pulled, self._stats = self._call("step")
        for uuid in pulled:
            self._inflight.pop(uuid, None)
        self._pinned = set(pinned)
        self.num_pending = len(pinned)
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


def serve(listen: str) -> None:
    """The decode process: builds its pool from the leader's config, then answers its calls."""
    from multiprocessing.connection import Listener

    import jax
    from jax.experimental import transfer

    from engine.kv_transfer import KVScatter
    from engine.llm_engine import LLMEngine
    from engine.mesh import replica_meshes

    host, port = _split_address(listen)
    with Listener((host, port), authkey=_authkey()) as listener, listener.accept() as conn:
        pool, peer, pulled = None, None, []
        made: dict = {}  # request id -> its newest output since the last `step` call
        wanted = False  # the leader's `step` call waits for outputs
        failed = None  # a step that raised: the answer to the next `step` call, then no more steps
        while True:
            busy = pool is not None and failed is None and pool.has_unfinished_requests()
            if wanted and failed is not None:
                conn.send(("error", failed))
                wanted = False
                continue
            if wanted and (made or not busy):
                conn.send(("ok", (list(made.values()), list(pool._pinned) if pool else [],
                                  (pool.pull_seconds, pool.num_pulled) if pool else (0.0, 0), pulled,
                                  pool.get_stats() if pool else None)))
                made, pulled, wanted = {}, [], False
                continue
            if busy and not conn.poll(0):  # nothing to process first: the next step
                try:
                    outputs = pool.step()
                except Exception as exc:  # the engine's own failure (a request's is an output)
                    failed = (type(exc).__name__, f"{type(exc).__name__}: {exc}")
                    continue
                for out in outputs:
                    made.pop(out.request_id, None)  # keep the order of the newest outputs
                    made[out.request_id] = out
                continue
            try:
                op, *args = conn.recv()
            except EOFError:  # the leader is gone: so is this pool
                return
            try:
                if op == "close":
                    return
                if op == "step":
                    wanted = True
                    continue
                if op == "start":
                    config, buckets, leader_address = args
                    size = config.tensor_parallel_size
                    mesh = replica_meshes(size, 1, jax.devices()[:size])[0]
                    engine = LLMEngine(config, progress=False, mesh=mesh)
                    pool = DecodePool(engine, KVScatter(engine.runner, buckets))
                    server = transfer.start_transfer_server(jax.devices()[0].client, f"{host}:0", [f"{host}:0"])
                    peer = server.connect(leader_address)
                    result = pool.num_blocks
                elif op == "write":  # pull the bucket onto this pool's sharding, then scatter it
                    uuid, dest_ids, bucket = args
                    start = time.perf_counter()
                    shape = jax.ShapeDtypeStruct(pool.scatter.shape(bucket), pool.scatter.dtype,
                                                 sharding=pool.scatter.sharding)
                    k, v = peer.pull(uuid, [shape, shape])
                    jax.block_until_ready((k, v))
                    pool.pull_seconds += time.perf_counter() - start
                    pool.num_pulled += 1
                    pool.write(dest_ids, k, v)
                    pulled.append(uuid)
                    continue  # one-way
                elif op == "accept":
                    result = pool.accept(*args)
                elif op == "add":
                    request_id, call_args, kwargs = args
                    result = pool.add_request(request_id, *call_args, **kwargs)
                elif op == "abort":
                    made.pop(args[0], None)
                    result = pool.abort_request(*args)
                elif op == "stats":
                    result = pool.get_stats()
                elif op == "reconfigure":
                    pool.reconfigure_scheduler(**args[0])
                    result = None
                else:
                    raise ValueError(f"decode pool: unknown call {op!r}")
                conn.send(("ok", result))
            except Exception as exc:  # the call fails; the pool serves on
                if op == "write":
                    raise
                conn.send(("error", (type(exc).__name__, f"{type(exc).__name__}: {exc}")))


def main(argv) -> None:
    from absl import flags

    del argv
    serve(flags.FLAGS.listen)


if __name__ == "__main__":
    from absl import app, flags

    flags.DEFINE_string("listen", "127.0.0.1:9555", "HOST:PORT the leader's PDEngine connects to "
                        "(EngineConfig.disaggregation decode_address); loopback by default")
    app.run(main)
