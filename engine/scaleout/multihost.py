"""Multi-host: one mesh over every process's devices on JAX's multi-controller runtime.

Every process calls `initialize(...)` (jax.distributed), builds the same engine over the global
device list (jax.devices() spans all processes; weights are placed shard by shard, each process
filling only its own devices), and compiles the same steps. Then:

1. Process 0 (the leader) runs the scheduler, the engine loop and the HTTP server. Its runner is a
   `LeaderRunner`: before each step it publishes the step's SchedulerOutput (pickled) under
   "jaxserve/step/<n>" in the coordination service's key-value store (JAX's own, the one
   jax.distributed starts; no other transport), then waits until every follower acknowledged
   step n ("jaxserve/ack/<n>/<p>") before it launches the compiled step.
2. Every other process runs `follow(runner)`: it reads step n, acknowledges it, and calls the same
   `runner.execute(scheduler_output)` (the same request-table updates, the same input buffer, the
   same executable), so every process launches the same collectives in the same order. A
   "stop" record ends the loop.
3. Start-up: each follower announces itself ("jaxserve/ready/<p>") once its engine is built and
   compiled; the leader waits `startup_timeout_s` for every one before its first step (a host
   that compiles slower is not a dead one), and names those that never came.
4. A follower that does not acknowledge within `timeout_s` (dead, or hung) makes the leader's step
   raise MultiHostError naming the process and its host; so does a step that does not finish
   within `step_timeout_s` (a process killed in the middle of a step can leave the survivors'
   collectives waiting for it for good: the compiled step runs on a thread of its own and the
   engine stops waiting for it). Either way the engine fails that step's requests and goes dead
   (the other processes cannot run a collective without it), and at exit the leader neither
   publishes "stop" nor waits at jax.distributed's shutdown barrier for the process that is gone
   (which would end in an abort): it exits with BROKEN_EXIT_STATUS.
   Both bounds come well before jax.distributed's heartbeat timeout, after which its coordination
   service ends every process. A leader that stops publishing makes each follower raise after
   `idle_timeout_s`; a dead coordinator makes every process's next read fail.
"""

from __future__ import annotations

import atexit
import pickle
import queue
import threading

import jax


class MultiHostError(RuntimeError):
    """A process of the mesh is gone or unreachable."""


BROKEN_EXIT_STATUS = 70  # the leader's exit status once its mesh broke (EX_SOFTWARE)


def initialize(coordinator_address: str, num_processes: int, process_id: int, *,
               timeout_s: int = 60, heartbeat_timeout_s: int = 30, shutdown_timeout_s: int = 30) -> None:
    """jax.distributed.initialize with timeouts; a coordinator that cannot be reached is a
    MultiHostError naming it, not a hang. `shutdown_timeout_s` bounds jax's own shutdown barrier
    at exit (it waits for every process, so for a dead one until then)."""
    if not 0 <= process_id < num_processes:
        raise ValueError(f"process_id={process_id} must be in [0, num_processes={num_processes})")
    try:
        jax.distributed.initialize(coordinator_address, num_processes, process_id,
                                   initialization_timeout=timeout_s,
                                   heartbeat_timeout_seconds=heartbeat_timeout_s,
                                   shutdown_timeout_seconds=shutdown_timeout_s)
    except Exception as exc:  # the runtime's own error text says what failed
        raise MultiHostError(f"process {process_id}: cannot join the mesh at coordinator "
                             f"{coordinator_address} within {timeout_s}s: {exc}") from exc


def _client():
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise MultiHostError("jax.distributed is not initialized (call engine.scaleout.multihost.initialize)")
    return client


def _host_of(process_id: int) -> str:
    hosts = {d.process_index: getattr(d, "host_id", d.process_index) for d in jax.devices()}
    return f"process {process_id} (host {hosts.get(process_id, '?')})"


class LeaderRunner:
    """Wraps process 0's ModelRunner: publish each step, wait for every follower, then run it."""

    def __init__(self, runner, *, timeout_s: float = 30.0, step_timeout_s: float = 120.0,
                 startup_timeout_s: float = 900.0):
        self.runner = runner
        self.timeout_s = timeout_s
        self.step_timeout_s = step_timeout_s
        self.num_steps = 0
        self.stopped = False
        self.broken = False
        self.broken_reason: str | None = None
        self._client = _client()
        self._followers = [p for p in range(jax.process_count()) if p != jax.process_index()]
        self._wait_ready(startup_timeout_s)
        self._work: queue.Queue = queue.Queue()
        # A daemon thread: one stuck in a collective of a dead process must not hold the exit.
        threading.Thread(target=self._step_loop, name="multihost-step", daemon=True).start()
        # At exit: "stop" to the followers, then jax.distributed's shutdown (registered after jax's
        # own exit hook, so it runs first); a broken mesh ends the process instead.
        atexit.register(_stop_quietly, self)

    def __getattr__(self, name):  # shapes, params, sample_vocab_size, healthy...
        return getattr(self.runner, name)

    def _wait_ready(self, timeout_s: float) -> None:
        for p in self._followers:
            try:
                self._client.blocking_key_value_get(f"jaxserve/ready/{p}", int(timeout_s * 1000))
            except Exception as exc:
                raise MultiHostError(f"{_host_of(p)} did not join within {timeout_s:g}s of start-up "
                                     f"(it died, or is still loading or compiling): {exc}") from exc

    def _break(self, reason: str, exc: Exception | None = None):
        self.broken = True
        self.broken_reason = reason
        raise MultiHostError(reason) from exc

    def _publish(self, payload: bytes) -> int:
        n = self.num_steps
        self.num_steps += 1
        self._client.key_value_set_bytes(f"jaxserve/step/{n}", payload)
        for p in self._followers:
            try:
                self._client.blocking_key_value_get(f"jaxserve/ack/{n}/{p}", int(self.timeout_s * 1000))
            except Exception as exc:
                self._break(f"multi-host step {n}: {_host_of(p)} did not acknowledge within "
                            f"{self.timeout_s:g}s (the follower died or hangs): {exc}", exc)
        return n

    def _step_loop(self) -> None:
        while True:
            scheduler_output, done = self._work.get()
            try:
                done.put((True, self.runner.execute(scheduler_output)))
            except BaseException as exc:  # noqa: BLE001 - handed to the engine's thread
                done.put((False, exc))

    def execute(self, scheduler_output):
        if self.broken:
            raise MultiHostError(f"the multi-host mesh is broken: {self.broken_reason}")
        n = self._publish(pickle.dumps(scheduler_output))
        done: queue.Queue = queue.Queue(1)
        self._work.put((scheduler_output, done))
        try:
            ok, value = done.get(timeout=self.step_timeout_s)
        except queue.Empty:
            self._break(f"multi-host step {n} did not finish within {self.step_timeout_s:g}s: a process "
                        "of the mesh died in the middle of it or hangs (its collectives wait for it)")
        if ok:
            return value
        if isinstance(value, jax.errors.JaxRuntimeError):  # a collective with a process gone
            # The mesh cannot run another step: the engine goes dead.
            self._break(f"multi-host step {n} failed (a process of the mesh died or its link broke): "
                        f"{value}", value)
        raise value

    @property
    def healthy(self) -> bool:
        return not self.broken and self.runner.healthy

    def stop(self) -> None:
        """Ends every follower's loop (they return from follow()); once. A broken mesh has no
        follower left to tell."""
        if not self.stopped and not self.broken:
            self.stopped = True
            self._publish(b"stop")


def follow(runner, *, idle_timeout_s: float = 3600.0) -> int:
    """A follower's loop: run every step the leader publishes, until "stop". Returns the steps run."""
    client, me = _client(), jax.process_index()
    client.key_value_set(f"jaxserve/ready/{me}", "1")  # built and compiled: the leader may start
    n = 0
    while True:
        try:
            payload = client.blocking_key_value_get_bytes(f"jaxserve/step/{n}", int(idle_timeout_s * 1000))
        except Exception as exc:
            raise MultiHostError(f"process {me}: no step {n} from the leader ({_host_of(0)}) within "
                                 f"{idle_timeout_s:g}s: {exc}") from exc
        client.key_value_set(f"jaxserve/ack/{n}/{me}", "1")
        n += 1
        if payload == b"stop":
            return n - 1
        runner.execute(pickle.loads(payload))


def engine_for_process(config, *, progress: bool = True):
    """Joins the mesh, builds this process's engine; the leader's comes back wrapped (its runner
    publishes every step, `engine.multihost_stop()` or process exit ends the followers), a
    follower runs `follow` and then exits the process."""
    import sys

    from engine.core.llm_engine import LLMEngine

    if config.data_parallel_size > 1:
        raise ValueError("EngineConfig.data_parallel_size > 1 with num_processes > 1 is not supported "
                         "yet: one multi-host mesh is one replica (use tensor_parallel_size)")
    initialize(config.coordinator_address, config.num_processes, config.process_id)
    engine = LLMEngine(config, progress=progress and config.process_id == 0)
    if config.process_id != 0:
        follow(engine.runner)
        shutdown()
        sys.exit(0)
    leader = LeaderRunner(engine.runner)
    engine.runner = leader
    engine.multihost_stop = leader.stop
    return engine


def _stop_quietly(leader: LeaderRunner) -> None:
    if leader.broken:
        # jax's own exit hook would wait at jax.distributed's shutdown barrier for the process that
        # is gone, then abort; a thread may still sit in one of its collectives. End here instead.
        import logging
        import os
        import sys

        logging.error("jaxserve: the multi-host mesh is broken (%s); exiting with status %d without "
                      "jax.distributed's shutdown", leader.broken_reason, BROKEN_EXIT_STATUS)
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(BROKEN_EXIT_STATUS)
    try:
        leader.stop()
        shutdown()
    except Exception:  # noqa: BLE001 - at exit a dead follower was already reported
        pass


def shutdown() -> None:
    """Leaves the mesh: a barrier with the other processes, so none outlives the coordinator."""
    jax.distributed.shutdown()
