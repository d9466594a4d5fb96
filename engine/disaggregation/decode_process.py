"""The decode process of prefill/decode disaggregation across processes: `serve(listen)` runs a
decode pool for one leader (`python -m engine.disaggregation.decode_pool --listen=HOST:PORT` calls
it). The protocol, seen from the leader, is in decode_pool.py (`RemoteDecodePool`); this is its
other end: a loop that steps the pool whenever it has work and, between steps, takes the leader's
messages (`start`, `step`, `offer`, `write`, `abort`, `stats`, `reconfigure`, `close`).
"""

from __future__ import annotations

import concurrent.futures
import time

from engine.disaggregation.connection import authkey, split_address
from engine.disaggregation.local_pool import DecodePool, failed_output
from scheduler import block_pool


def serve(listen: str) -> None:
    """The decode process: builds its pool from the leader's config, then answers its calls."""
    from multiprocessing.connection import Listener

    import jax
    from jax.experimental import transfer

    from engine.core.llm_engine import LLMEngine
    from engine.disaggregation.kv_transfer import KVScatter
    from engine.step.mesh import replica_meshes

    host, port = split_address(listen)
    with Listener((host, port), authkey=authkey()) as listener, listener.accept() as conn:
        pool, peer, pulled = None, None, []
        made: dict = {}  # request id -> its newest output since the last `step` call
        accepted: list[tuple[str, bool]] = []  # offers answered since: (request id, bucket wanted)
        # Accepted offers whose bucket has not landed: request id -> dest ids. Their blocks are
        # in the prefix cache already, so the scheduler admits nothing until every one has
        # landed (an admission could read them; running requests never hold them, so their
        # steps go on while the buckets are pulled), and an aborted one keeps its pins until
        # then (nothing reuses the blocks).
        unwritten: dict[str, list[int]] = {}
        aborted: set[str] = set()  # of those, aborted
        pulls: dict[str, tuple] = {}  # of those, being pulled on a thread: (uuid, future)
        puller = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kv-pull")
        num_fallbacks = 0
        wanted = False  # the leader's `step` call waits for outputs
        failed = None  # a step that raised: the answer to the next `step` call, then no more steps

        def pull(uuid: int, bucket: int):  # on the puller thread, while steps run
            start = time.perf_counter()
            abstract = pool.scatter.abstract(bucket)  # (k, v): arrays, or an 8-bit cache's values and scales
            k, v = jax.tree.unflatten(jax.tree.structure(abstract), peer.pull(uuid, jax.tree.leaves(abstract)))
            jax.block_until_ready((k, v))
            return k, v, time.perf_counter() - start

        def land_pulls() -> None:
            for request_id, (uuid, future) in list(pulls.items()):
                if not future.done():
                    continue
                del pulls[request_id]
                k, v, seconds = future.result()  # a failed pull ends this process, as a failed step would not
                pool.pull_seconds += seconds
                pool.num_pulled += 1
                pulled.append(uuid)
                pool.write(unwritten.pop(request_id), k, v)  # between steps: the cache is donated
                if request_id in aborted:  # its blocks hold their data now: the pins can go
                    aborted.discard(request_id)
                    pool.abort_request(request_id)
            pool.engine.scheduler.admissions_held = bool(unwritten)

        def add(request_id: str, add_args, add_kwargs) -> None:
            try:
                pool.add_request(request_id, *add_args, **add_kwargs)
            except Exception as exc:  # this request fails; the pool serves on
                made[request_id] = failed_output(_resumed(request_id, add_args, add_kwargs), exc)

        while True:
            if pulls:
                land_pulls()
            # Work to step: running requests, or waiting ones it may admit.
            busy = pool is not None and failed is None and pool.has_unfinished_requests() and (
                not unwritten or bool(pool.engine.scheduler.running))
            if wanted and failed is not None:
                conn.send(("error", failed))
                wanted = False
                continue
            if wanted and (made or accepted or not (busy or unwritten)):
                conn.send(("ok", (list(made.values()), list(pool._pinned), (pool.pull_seconds, pool.num_pulled),
                                  pulled, pool.get_stats(), accepted, num_fallbacks)))
                made, pulled, accepted, wanted = {}, [], [], False
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
            if pulls and not conn.poll(0.002):  # nothing to step: wait for a pull or a message
                continue
            try:
                op, *args = conn.recv()
            except EOFError:  # the leader is gone: so is this pool
                return
            if op == "close":
                return
            if op == "step":
                wanted = True
            elif op == "offer":  # one-way: answered in `accepted` with the next step
                request_id, hashes, add_args, add_kwargs = args
                try:
                    to_write = pool.accept(request_id, hashes)
                except Exception as exc:
                    made[request_id] = failed_output(_resumed(request_id, add_args, add_kwargs), exc)
                    accepted.append((request_id, False))
                    continue
                num_fallbacks += to_write is None  # full: it recomputes the prompt
                accepted.append((request_id, bool(to_write)))
                if to_write:
                    unwritten[request_id] = pool.dest_ids(len(hashes), to_write)
                    pool.engine.scheduler.admissions_held = True
                add(request_id, add_args, add_kwargs)  # queued; admitted once its bucket has landed
            elif op == "write":  # one-way: pull the bucket onto this pool's sharding (on a thread)
                uuid, request_id, bucket = args
                pulls[request_id] = (uuid, puller.submit(pull, uuid, bucket))
            elif op == "abort":  # one-way
                made.pop(args[0], None)
                if args[0] in unwritten:  # its pins stay until its bucket lands
                    pool.engine.abort_request(args[0])
                    aborted.add(args[0])
                else:
                    pool.abort_request(args[0])
            else:
                try:
                    if op == "start":
                        config, buckets, leader_address, block_pool.ROOT_BLOCK_HASH = args  # the leader's hashes
                        size = config.tensor_parallel_size
                        mesh = replica_meshes(size, 1, jax.devices()[:size])[0]
                        engine = LLMEngine(config, progress=False, mesh=mesh)
                        pool = DecodePool(engine, KVScatter(engine.runner, buckets))
                        server = transfer.start_transfer_server(jax.devices()[0].client, f"{host}:0", [f"{host}:0"])
                        peer = server.connect(leader_address)
                        result = pool.num_blocks
                    elif op == "stats":
                        result = pool.get_stats()
                    elif op == "reconfigure":
                        pool.reconfigure_scheduler(**args[0])
                        result = None
                    else:
                        raise ValueError(f"decode pool: unknown call {op!r}")
                    conn.send(("ok", result))
                except Exception as exc:  # the call fails; the pool serves on
                    conn.send(("error", (type(exc).__name__, f"{type(exc).__name__}: {exc}")))


def _resumed(request_id: str, add_args, add_kwargs):
    """The output a handed-over request had when it left the prefill pool."""
    from engine.outputs import RequestMetrics, RequestOutput

    prompt_ids, _, arrival = add_args
    resume = add_kwargs["resume"]
    return RequestOutput(request_id, add_kwargs.get("prompt_text"), list(prompt_ids), list(resume.first),
                         metrics=RequestMetrics(arrival, first_token_time=resume.first_token_time))
