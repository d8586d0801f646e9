"""Where the learner's trajectories come from: ``TrajectorySource.take(n, policy_version)``.

A source is a transport: it hands prompts to the rollout side and brings finished trajectories
back. What happens between the prompt ledger and the batch (groups, the grpo_sync barrier, the
staleness policy, ledger consumption, length statistics, the metric names) is the one take loop
both sources share, ``rollout.assembler.BatchAssembler``.

``ThreadSource`` runs one ``RolloutWorker`` on a thread of this process (the embedded default,
``rollout.backend="thread"``); with ``rollout.lockstep`` it samples each batch synchronously
instead (deterministic: bit-exact resume).
"""

from __future__ import annotations

import collections
import queue as queue_lib
import threading
import time
from typing import Any, Protocol

from sao_jax import faults
from sao_jax.rollout.assembler import Arrival, BatchAssembler
from sao_jax.rollout.ledger import PromptLedger
from sao_jax.rollout.sync import TrajectoryQueue, WeightStore
from sao_jax.rollout.trajectory import Trajectory
from sao_jax.rollout.worker import RolloutWorker, generate_trajectories


class TrajectorySource(Protocol):
  """What the driver needs from the rollout side."""

  def take(self, n: int, policy_version: int) -> list[Trajectory]:
    """Blocks until ``n`` trajectories (whole groups) are ready; consumes their prompts."""

  def publish(self, params: Any, version: int) -> None:
    """New policy weights for the rollout side (``version`` strictly increasing)."""

  def metrics(self) -> dict[str, float]:
    """Rollout counters since the start (and rates since the last call)."""

  def state(self) -> dict:
    """JSON-serialisable ledger cursor for checkpoints."""

  def close(self) -> None:
    """Stops the rollout side."""


class ThreadSource:
  """A ``TrajectorySource`` over one ``RolloutWorker`` running on a thread of this process.

  Args:
    engine: the ``SAOEngine`` the worker drives.
    env: the (guarded) multi-turn environment.
    ledger: the ``PromptLedger`` (fresh, or restored from a checkpoint).
    params / version: the weights the worker starts with.
    stop_ids, stop_strings, max_new_tokens, max_seq_len, temperature: as ``RolloutWorker``.
    batch_size: trajectories per policy step (admission control and the grpo_sync barrier).
    group_size: rollouts per prompt (1 = SAO's single rollout).
    synchronous: the grpo_sync barrier (batch n+1 admitted only after step n is published).
    queue_size: bound of the trajectory queue (back-pressure on the worker).
    staleness_policy / max_staleness: ``rollout.staleness`` policy and eta.
    kv_on_update, env_workers, seed, decode_steps, overlap_host: as ``RolloutWorker``.
    lockstep: deterministic synchronous rollout per step (no thread; groups of
      ``group_size`` rollouts of one prompt are sampled side by side).
    lockstep_delay: d >= 0, lockstep only: the batch trained at version v is sampled with the
      weights of version max(0, v - d), so every action token's staleness is exactly min(d, v)
      -- the same for every arm of an experiment (a fixed delay, the cleanest staleness
      control there is; the weights of the last d versions are kept).
    run_dir: where ``ledger.jsonl`` is appended ("" = not written).

  Raises ValueError for a delay without lockstep, a bad staleness policy, or lockstep with a
  staleness policy (``BatchAssembler``).
  """

  def __init__(self, engine, env, ledger: PromptLedger, params, version: int, *, stop_ids,
               max_new_tokens: int, max_seq_len: int, temperature: float, batch_size: int,
               group_size: int = 1, synchronous: bool = False, queue_size: int = 64,
               staleness_policy: str = "none", max_staleness: int = -1,
               kv_on_update: str = "keep", env_workers: int = 0, seed: int = 0,
               lockstep: bool = False, lockstep_delay: int = 0, run_dir: str = "",
               stop_strings=(), decode_steps: int = 1, overlap_host: bool = False):
    if lockstep_delay and not lockstep or lockstep_delay < 0:
      raise ValueError(f"rollout.lockstep_delay={lockstep_delay} needs rollout.lockstep=True and "
                       "must be >= 0; set rollout.lockstep=True or rollout.lockstep_delay=0.")
    self.assembler = BatchAssembler(
        ledger, batch_size=batch_size, group_size=group_size, synchronous=synchronous,
        staleness_policy=staleness_policy, max_staleness=max_staleness, lockstep=lockstep,
        run_dir=run_dir)
    self.delay = int(lockstep_delay)
    self._history = collections.OrderedDict({version: params})  # lockstep_delay: version->params
    self.engine, self.env, self.ledger = engine, env, ledger
    self.group_size, self.batch_size = group_size, batch_size
    self.lockstep, self.seed, self.temperature = lockstep, seed, temperature
    self._gen = dict(stop_ids=stop_ids, max_new_tokens=max_new_tokens, max_seq_len=max_seq_len,
                     stop_strings=tuple(stop_strings), decode_steps=int(decode_steps),
                     overlap_host=bool(overlap_host))
    self.weights = WeightStore(params, version=version)
    self.queue = TrajectoryQueue(queue_size)
    self.stop = threading.Event()
    self.worker = RolloutWorker(engine, env, self.assembler.problems,
                                lambda t: self.queue.put(t, self.stop), self.weights,
                                temperature=temperature, seed=seed, kv_on_update=kv_on_update,
                                admission=self.assembler.admission,
                                env_workers=0 if lockstep else env_workers, **self._gen)
    self.thread = None if lockstep else self.worker.start_thread(self.stop)
    self._last = (0, time.time())

  @property
  def lengths(self):
    """Generated / trained / dropped response lengths (``assembler.LengthStats``)."""
    return self.assembler.lengths

  def _lockstep(self, n: int, version: int) -> list[Trajectory]:
    step = version + 1
    faults.maybe_kill("rollout", step)
    g = self.group_size
    handouts = [h for h in self.ledger.take(n // g) for _ in range(g)]
    seed = faults.step_seed(self.seed, step)
    self.engine.reseed(seed)
    sampled_with = max(min(self._history), version - self.delay)
    out = generate_trajectories(self.engine, self.env, self._history[sampled_with], handouts,
                                temperature=self.temperature, version=sampled_with, seed=seed,
                                **self._gen)
    self.worker.stats.trajectories += len(out)
    self.worker.stats.tokens_sampled += sum(t.num_action_tokens for t in out)
    return out

  def _next_arrival(self) -> Arrival:
    """The worker's next finished trajectory (waits up to 1 s). Raises RuntimeError if the
    rollout worker died (with its error)."""
    try:
      return self.queue.get(timeout=1.0)
    except queue_lib.Empty:
      if self.worker.error is not None or not self.thread.is_alive():
        raise RuntimeError(f"the rollout worker stopped: {self.worker.error!r}"
                           ) from self.worker.error
      return None

  def take(self, n: int, policy_version: int) -> list[Trajectory]:
    """``n`` trajectories (whole groups; ``n`` a multiple of ``group_size``) through
    ``BatchAssembler.take``: groups, drop-on-arrival, ledger consumption. Lockstep samples
    exactly those ``n`` now. Raises RuntimeError if the rollout worker died (with its error)."""
    if self.lockstep:
      arrivals = iter(self._lockstep(n, policy_version))
      return self.assembler.take(n, policy_version, lambda: (next(arrivals), 0.0))
    return self.assembler.take(n, policy_version, self._next_arrival)

  def publish(self, params, version: int) -> None:
    self.weights.publish(params, version)
    if self.lockstep:
      self._history[version] = params
      while len(self._history) > self.delay + 1:
        self._history.popitem(last=False)
    self.assembler.published(version)  # grpo_sync: the next batch starts on the new weights

  def metrics(self) -> dict[str, float]:
    s = self.worker.stats
    now = time.time()
    tokens, t_last = self._last
    self._last = (s.tokens_sampled, now)
    slots = max(1, len(self.worker.slots))
    return {"tokens_per_s": (s.tokens_sampled - tokens) / max(now - t_last, 1e-9),
            "queue_size": float(self.queue.qsize()),
            "rollout_generate_s": s.generate_s, "rollout_prefill_s": s.prefill_s,
            "rollout_env_wait_s": s.env_wait_s, "rollout_sink_s": self.worker.sink_s_now(),
            "rollout_trajectories": float(s.trajectories), "rollout_idle_s": s.idle_s,
            "rollout_generate_steps": float(s.generate_steps),
            "rollout_tokens_discarded": float(s.tokens_discarded),
            "rollout_overlapped_calls": float(s.overlapped_calls),
            "rollout_slot_occupancy": s.decode_slot_steps / max(1, s.generate_steps * slots),
            "env_errors_total": float(s.env_errors), **self.assembler.metrics()}

  def state(self) -> dict:
    return self.ledger.state()

  def close(self) -> None:
    self.stop.set()
    if self.thread is not None:
      self.thread.join(timeout=30)
