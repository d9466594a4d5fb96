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
3. A follower that does not acknowledge within `timeout_s` (dead, or hung) makes the leader's step
   raise MultiHostError naming the process and its host; the engine fails that step's requests
   and goes dead (the other processes cannot run a collective without it). A leader that stops
   publishing makes each follower raise after `idle_timeout_s`; a dead coordinator makes every
   process's next read fail.
"""

from __future__ import annotations

import pickle

import jax


class MultiHostError(RuntimeError):
    """A process of the mesh is gone or unreachable."""


def initialize(coordinator_address: str, num_processes: int, process_id: int, *,
               timeout_s: int = 60, heartbeat_timeout_s: int = 30) -> None:
    """jax.distributed.initialize with timeouts; a coordinator that cannot be reached is a
    MultiHostError naming it, not a hang."""
    if not 0 <= process_id < num_processes:
        raise ValueError(f"process_id={process_id} must be in [0, num_processes={num_processes})")
    try:
        jax.distributed.initialize(coordinator_address, num_processes, process_id,
                                   initialization_timeout=timeout_s,
                                   heartbeat_timeout_seconds=heartbeat_timeout_s)
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

    def __init__(self, runner, *, timeout_s: float = 30.0):
        self.runner = runner
        self.timeout_s = timeout_s
        self.num_steps = 0
        self.stopped = False
        self.broken = False
        self._client = _client()
        self._followers = [p for p in range(jax.process_count()) if p != jax.process_index()]

    def __getattr__(self, name):  # shapes, params, sample_vocab_size, healthy...
        return getattr(self.runner, name)

    def _publish(self, payload: bytes) -> int:
        n = self.num_steps
        self.num_steps += 1
        self._client.key_value_set_bytes(f"jaxserve/step/{n}", payload)
        for p in self._followers:
            try:
                self._client.blocking_key_value_get(f"jaxserve/ack/{n}/{p}", int(self.timeout_s * 1000))
            except Exception as exc:
                self.broken = True
                raise MultiHostError(f"multi-host step {n}: {_host_of(p)} did not acknowledge within "
                                     f"{self.timeout_s:g}s (the follower died or hangs): {exc}") from exc
        return n

    def execute(self, scheduler_output):
        n = self._publish(pickle.dumps(scheduler_output))
        try:
            return self.runner.execute(scheduler_output)
        except jax.errors.JaxRuntimeError as exc:  # a collective with a process gone
            self.broken = True  # the mesh cannot run another step: the engine goes dead
            raise MultiHostError(f"multi-host step {n} failed (a process of the mesh died or its "
                                 f"link broke): {exc}") from exc

    @property
    def healthy(self) -> bool:
        return not self.broken and self.runner.healthy

    def stop(self) -> None:
        """Ends every follower's loop (they return from follow()); once."""
        if not self.stopped:
            self.stopped = True
            self._publish(b"stop")


def follow(runner, *, idle_timeout_s: float = 3600.0) -> int:
    """A follower's loop: run every step the leader publishes, until "stop". Returns the steps run."""
    client, me = _client(), jax.process_index()
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
    import atexit
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
    atexit.register(_stop_quietly, leader)
    return engine


def _stop_quietly(leader: LeaderRunner) -> None:
    try:
        leader.stop()
        shutdown()
    except Exception:  # noqa: BLE001 - at exit a dead follower was already reported
        pass


def shutdown() -> None:
    """Leaves the mesh: a barrier with the other processes, so none outlives the coordinator."""
    jax.distributed.shutdown()
