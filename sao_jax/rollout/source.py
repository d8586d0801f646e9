"""Where the learner's trajectories come from: ``TrajectorySource.take(n, policy_version)``.

A source owns everything between the prompt ledger and a list of finished trajectories:

* the **prompt ledger** (``rollout.ledger``): prompts are handed out by position; ``take``
  consumes the positions of what it returns, exactly once, and writes ``ledger.jsonl``;
* **GRPO groups**: with ``group_size`` G > 1 every hand-out is rolled out G times and ``take``
  returns whole groups only (members share ``Trajectory.prompt_position``);
* the **synchronous barrier** (``grpo_sync``): prompts for batch n+1 are released only when the
  weights of step n are published;
* **staleness control** (``rollout.staleness``): AReaL admission and/or drop-on-arrival; the
  generated, trained and dropped response lengths are counted (the drop policy's bias);
* **lockstep** (``rollout.lockstep``): a deterministic synchronous batch per step (bit-exact
  resume).

``ThreadSource`` runs one ``RolloutWorker`` on a thread of this process (the embedded default,
``rollout.backend="thread"``).
"""

from __future__ import annotations

import collections
import dataclasses
import queue as queue_lib
import threading
import time
from typing import Any, Iterator, Protocol

import numpy as np

from sao_jax import faults
from sao_jax.rollout import staleness
from sao_jax.rollout.ledger import Handout, PromptLedger, append_ledger
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


def repeat_groups(handouts: Iterator[Handout], group_size: int) -> Iterator[Handout]:
  """Yields each hand-out ``group_size`` times in a row (one GRPO group per prompt)."""
  for h in handouts:
    for _ in range(group_size):
      yield h


class GatedProblems:
  """A hand-out iterator that gives only as many as the trainer released.

  ``next()`` returns None (not StopIteration) when the quota is used up: the rollout worker then
  leaves the slot empty and asks again later. The grpo_sync barrier: the trainer publishes the
  new weights and only then calls ``release(n)``, so batch n+1 is sampled entirely by the weights
  of step n. Thread-safe."""

  def __init__(self, problems: Iterator):
    self._problems = problems
    self._quota = 0
    self._lock = threading.Lock()

  def release(self, n: int) -> None:
    with self._lock:
      self._quota += int(n)

  def __iter__(self):
    return self

  def __next__(self):
    with self._lock:
      if self._quota <= 0:
        return None
      self._quota -= 1
    return next(self._problems)


class GroupCollector:
  """Assembles trajectories into complete groups of ``group_size`` (by ``prompt_position``), in
  order of completion. ``add`` returns the list of groups that trajectory completed (0 or 1)."""

  def __init__(self, group_size: int):
    self.group_size = group_size
    self._pending: dict[int, list[Trajectory]] = collections.OrderedDict()

  def add(self, traj: Trajectory) -> list[list[Trajectory]]:
    if self.group_size == 1:
      return [[traj]]
    members = self._pending.setdefault(traj.prompt_position, [])
    members.append(traj)
    if len(members) == self.group_size:
      del self._pending[traj.prompt_position]
      return [members]
    return []

  @property
  def pending(self) -> int:
    return sum(len(v) for v in self._pending.values())


@dataclasses.dataclass
class LengthStats:
  """Response lengths (action tokens) of generated, trained and dropped trajectories."""
  generated: list = dataclasses.field(default_factory=list)
  trained: list = dataclasses.field(default_factory=list)
  dropped: list = dataclasses.field(default_factory=list)

  def summary(self) -> dict[str, float]:
    mean = lambda xs: float(np.mean(xs)) if xs else 0.0
    return {"response_tokens_generated_mean": mean(self.generated),
            "response_tokens_trained_mean": mean(self.trained),
            "response_tokens_dropped_mean": mean(self.dropped),
            "trajectories_dropped": float(len(self.dropped))}


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
    kv_on_update, env_workers, seed: as ``RolloutWorker``.
    lockstep: deterministic synchronous rollout per step (no thread; groups of
      ``group_size`` rollouts of one prompt are sampled side by side).
    lockstep_delay: d >= 0, lockstep only: the batch trained at version v is sampled with the
      weights of version max(0, v - d), so every action token's staleness is exactly min(d, v)
      -- the same for every arm of an experiment (a fixed delay, the cleanest staleness
      control there is; the weights of the last d versions are kept).
    run_dir: where ``ledger.jsonl`` is appended ("" = not written).

  Raises ValueError for a delay without lockstep or a bad staleness policy.
  """

  def __init__(self, engine, env, ledger: PromptLedger, params, version: int, *, stop_ids,
               max_new_tokens: int, max_seq_len: int, temperature: float, batch_size: int,
               group_size: int = 1, synchronous: bool = False, queue_size: int = 64,
               staleness_policy: str = "none", max_staleness: int = -1,
               kv_on_update: str = "keep", env_workers: int = 0, seed: int = 0,
               lockstep: bool = False, lockstep_delay: int = 0, run_dir: str = "",
               stop_strings=(), decode_steps: int = 1):
    staleness.check_policy(staleness_policy, max_staleness)
    if lockstep_delay and not lockstep or lockstep_delay < 0:
      raise ValueError(f"rollout.lockstep_delay={lockstep_delay} needs rollout.lockstep=True and "
                       "must be >= 0; set rollout.lockstep=True or rollout.lockstep_delay=0.")
    self.delay = int(lockstep_delay)
    self._history = collections.OrderedDict({version: params})  # lockstep_delay: version->params
    self.engine, self.env, self.ledger = engine, env, ledger
    self.group_size, self.batch_size, self.run_dir = group_size, batch_size, run_dir
    self.lockstep, self.seed, self.temperature = lockstep, seed, temperature
    self._gen = dict(stop_ids=stop_ids, max_new_tokens=max_new_tokens, max_seq_len=max_seq_len,
                     stop_strings=tuple(stop_strings), decode_steps=int(decode_steps))
    self.weights = WeightStore(params, version=version)
    self.drop_eta = max_staleness if "drop" in staleness_policy else -1
    self.admission = (staleness.AdmissionControl(max_staleness, batch_size)
                      if "admission" in staleness_policy else None)
    problems: Iterator = repeat_groups(ledger, group_size) if group_size > 1 else ledger
    self.gate = None
    if synchronous:
      problems = self.gate = GatedProblems(problems)
      self.gate.release(batch_size)
    self.queue = TrajectoryQueue(queue_size)
    self.collector = GroupCollector(group_size)
    self.lengths = LengthStats()
    self.stop = threading.Event()
    self.worker = RolloutWorker(engine, env, problems, lambda t: self.queue.put(t, self.stop),
                                self.weights, temperature=temperature, seed=seed,
                                kv_on_update=kv_on_update, admission=self.admission,
                                env_workers=0 if lockstep else env_workers, **self._gen)
    self.thread = None if lockstep else self.worker.start_thread(self.stop)
    self._last = (0, time.time())
    self.wait_s = 0.0
    self.queue_age_s = 0.0

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
    self.lengths.generated.extend(t.num_action_tokens for t in out)
    return out

  def take(self, n: int, policy_version: int) -> list[Trajectory]:
    """``n`` trajectories (whole groups; ``n`` must be a multiple of ``group_size``), dropping
    units staler than ``max_staleness`` versions under a drop policy; consumes their prompts in
    the ledger. Raises RuntimeError if the rollout worker died (with its error)."""
    t0 = time.perf_counter()
    out, ages = [], []
    if self.lockstep:
      out = self._lockstep(n, policy_version)
    while len(out) < n:
      if len(out) == n // 2:
        faults.maybe_kill("rollout", policy_version + 1)
      try:
        traj, age = self.queue.get(timeout=1.0)
      except queue_lib.Empty:
        if self.worker.error is not None or not self.thread.is_alive():
          raise RuntimeError(f"the rollout worker stopped: {self.worker.error!r}"
                             ) from self.worker.error
        continue
      ages.append(age)
      self.lengths.generated.append(traj.num_action_tokens)
      for unit in self.collector.add(traj):
        if any(staleness.is_too_stale(t, policy_version, self.drop_eta) for t in unit
               ) if self.drop_eta >= 0 else False:
          self.lengths.dropped.extend(t.num_action_tokens for t in unit)
          self.ledger.consume([unit[0].prompt_position])  # dropped work is done work
          for _ in unit if self.admission is not None else ():
            self.admission.revoke()  # dropped work frees its admission place
        else:
          out.extend(unit)
    self.lengths.trained.extend(t.num_action_tokens for t in out)
    self.ledger.consume(sorted({t.prompt_position for t in out}))
    if self.run_dir:
      append_ledger(self.run_dir, policy_version + 1, out)
    self.wait_s = time.perf_counter() - t0
    self.queue_age_s = float(np.mean(ages)) if ages else 0.0
    return out

  def publish(self, params, version: int) -> None:
    self.weights.publish(params, version)
    if self.lockstep:
      self._history[version] = params
      while len(self._history) > self.delay + 1:
        self._history.popitem(last=False)
    if self.gate is not None:  # grpo_sync: the next batch starts only on the new weights
      self.gate.release(self.batch_size)

  def metrics(self) -> dict[str, float]:
    s = self.worker.stats
    now = time.time()
    tokens, t_last = self._last
    self._last = (s.tokens_sampled, now)
    slots = max(1, len(self.worker.slots))
    return {"tokens_per_s": (s.tokens_sampled - tokens) / max(now - t_last, 1e-9),
            "wait_s": self.wait_s, "queue_age_s": self.queue_age_s,
            "queue_size": float(self.queue.qsize()),
            "rollout_generate_s": s.generate_s, "rollout_prefill_s": s.prefill_s,
            "rollout_env_wait_s": s.env_wait_s, "rollout_sink_s": self.worker.sink_s_now(),
            "rollout_trajectories": float(s.trajectories), "rollout_idle_s": s.idle_s,
            "rollout_generate_steps": float(s.generate_steps),
            "rollout_tokens_discarded": float(s.tokens_discarded),
            "rollout_slot_occupancy": s.decode_slot_steps / max(1, s.generate_steps * slots),
            "env_errors_total": float(s.env_errors),
            "dropped_stale": float(len(self.lengths.dropped)),
            **{k: v for k, v in self.lengths.summary().items() if k != "trajectories_dropped"}}

  def state(self) -> dict:
    return self.ledger.state()

  def close(self) -> None:
    self.stop.set()
    if self.thread is not None:
      self.thread.join(timeout=30)
