"""The one take loop of every trajectory source: ``BatchAssembler``.

Both sources (``rollout.source.ThreadSource``, ``rollout.ray_source.RaySource``) are transports:
they hand prompts to the rollout side and bring finished trajectories back. Everything between
the prompt ledger and the batch the learner trains on happens here, once:

* **groups** (``group_size`` G > 1): every hand-out is rolled out G times
  (``repeat_groups``) and a batch holds whole groups only (``GroupCollector``, by
  ``Trajectory.prompt_position``);
* the **grpo_sync barrier** (``synchronous``): prompts for batch n+1 are released
  (``GatedProblems``) only when the weights of step n are published (``published``);
* the **staleness policy** (``rollout.staleness``): AReaL admission (the ``AdmissionControl``
  built here, asked by the transport before each hand-out) and drop-on-arrival
  (``max_staleness``): a unit (one trajectory, or one group) with any member staler than eta is
  dropped, its prompt consumed (dropped work is done work) and its admission places revoked;
* the **ledger**: the positions of what ``take`` returns are consumed exactly once and
  appended to ``ledger.jsonl``;
* **length statistics** and the **metric names** both backends log (``metrics``).
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from typing import Callable, Iterator, Optional

import numpy as np

from sao_jax import faults
from sao_jax.rollout import staleness
from sao_jax.rollout.ledger import Handout, PromptLedger, append_ledger
from sao_jax.rollout.trajectory import Trajectory

# (trajectory, seconds it waited on the rollout side's queue), or None: nothing arrived yet
Arrival = Optional[tuple[Trajectory, float]]


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
    """Allows ``n`` more hand-outs."""
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
    """Adds one arrival; returns the groups it completed."""
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
    """Trajectories waiting for the rest of their group."""
    return sum(len(v) for v in self._pending.values())


@dataclasses.dataclass
class LengthStats:
  """Response lengths (action tokens) of generated, trained and dropped trajectories."""
  generated: list = dataclasses.field(default_factory=list)
  trained: list = dataclasses.field(default_factory=list)
  dropped: list = dataclasses.field(default_factory=list)

  def summary(self) -> dict[str, float]:
    """Mean length of each set (0.0 when empty)."""
    mean = lambda xs: float(np.mean(xs)) if xs else 0.0
    return {"response_tokens_generated_mean": mean(self.generated),
            "response_tokens_trained_mean": mean(self.trained),
            "response_tokens_dropped_mean": mean(self.dropped)}


class BatchAssembler:
  """Turns arriving trajectories into the learner's batches; one per source.

  Args:
    ledger: the run's ``PromptLedger`` (fresh, or restored from a checkpoint).
    batch_size: trajectories per policy step (the admission budget and the grpo_sync release;
      unused otherwise).
    group_size: rollouts per prompt (G >= 1; 1 = SAO's single rollout).
    synchronous: the grpo_sync barrier (``problems`` yields None until ``published``).
    staleness_policy / max_staleness: ``rollout.staleness_policy`` ("none", "admission",
      "drop", "admission+drop") and eta (versions).
    lockstep: the source samples each batch synchronously (``rollout.lockstep``): nothing can
      be stale, so a staleness policy other than "none" is refused.
    run_dir: where ``ledger.jsonl`` is appended ("" = not written).

  Attributes the transport uses: ``problems`` (the hand-out iterator: groups repeated, gated
  under the barrier), ``admission`` (an ``AdmissionControl`` or None: ``try_start`` before a
  hand-out, ``finish`` when a rollout ends; the rollout side calls both).

  Raises ValueError naming the field for a bad policy, ``max_staleness``, ``group_size``,
  ``batch_size`` (< 1 with admission or the barrier) or lockstep with a staleness policy.
  """

  def __init__(self, ledger: PromptLedger, *, batch_size: int, group_size: int = 1,
               synchronous: bool = False, staleness_policy: str = "none",
               max_staleness: int = -1, lockstep: bool = False, run_dir: str = ""):
    staleness.check_policy(staleness_policy, max_staleness)
    if group_size < 1:
      raise ValueError(f"train.group_size={group_size}; need >= 1 rollouts per prompt.")
    if synchronous and batch_size < 1:
      raise ValueError(f"train.batch_size={batch_size}: the grpo_sync barrier releases a batch "
                       "of prompts per step; set train.batch_size >= 1.")
    if lockstep and staleness_policy != "none":
      raise ValueError(f"rollout.lockstep=True samples every batch synchronously, so "
                       f"rollout.staleness_policy={staleness_policy!r} would do nothing; set "
                       "rollout.staleness_policy='none' or rollout.lockstep=False.")
    self.ledger, self.run_dir = ledger, run_dir
    self.batch_size, self.group_size = int(batch_size), int(group_size)
    self.drop_eta = int(max_staleness) if "drop" in staleness_policy else -1
    self.admission = (staleness.AdmissionControl(max_staleness, batch_size)
                      if "admission" in staleness_policy else None)
    problems: Iterator = repeat_groups(ledger, group_size) if group_size > 1 else ledger
    self.gate = None
    if synchronous:
      problems = self.gate = GatedProblems(problems)
      self.gate.release(batch_size)
    self.problems = problems
    self.collector = GroupCollector(group_size)
    self.lengths = LengthStats()
    self.last_positions: list[int] = []
    self.wait_s = 0.0
    self.queue_age_s = 0.0

  def published(self, version: int) -> None:  # pylint: disable=unused-argument
    """The trainer published the weights of ``version``: under the barrier, the next batch's
    prompts are released."""
    if self.gate is not None:
      self.gate.release(self.batch_size)

  def is_stale(self, unit: list[Trajectory], policy_version: int) -> bool:
    """Drop-on-arrival: any member of ``unit`` staler than ``max_staleness`` (never without a
    drop policy)."""
    return self.drop_eta >= 0 and any(
        staleness.is_too_stale(t, policy_version, self.drop_eta) for t in unit)

  def take(self, n: int, policy_version: int,
           next_arrival: Callable[[], Arrival]) -> list[Trajectory]:
    """Collects ``n`` trajectories (whole groups) for the step that trains at ``policy_version``.

    ``next_arrival()`` is the transport: the next finished trajectory and its queue age in
    seconds, or None when none arrived yet (it waits a little itself, and raises when the
    rollout side is gone). Arrivals are grouped, stale units dropped (prompt consumed,
    admission revoked), and the positions returned are consumed in the ledger
    (``last_positions``) and appended to ``ledger.jsonl``. The fault point ``rollout`` fires
    once half the batch is collected.

    Returns the trajectories in order of arrival (groups contiguous). Raises ValueError when
    ``n`` is not a positive multiple of ``group_size``.
    """
    if n < 1 or n % self.group_size:
      raise ValueError(f"take(n={n}): n must be a positive multiple of "
                       f"train.group_size={self.group_size}.")
    t0 = time.perf_counter()
    out: list[Trajectory] = []
    ages: list[float] = []
    kill_at = n // 2
    while len(out) < n:
      if len(out) >= kill_at:
        faults.maybe_kill("rollout", policy_version + 1)
        kill_at = n + 1
      arrival = next_arrival()
      if arrival is None:
        continue
      traj, age = arrival
      ages.append(float(age))
      self.lengths.generated.append(traj.num_action_tokens)
      for unit in self.collector.add(traj):
        if self.is_stale(unit, policy_version):
          self.lengths.dropped.extend(t.num_action_tokens for t in unit)
          self.ledger.consume([unit[0].prompt_position])  # dropped work is done work
          for _ in unit if self.admission is not None else ():
            self.admission.revoke()  # and frees its admission place
        else:
          out.extend(unit)
    self.lengths.trained.extend(t.num_action_tokens for t in out)
    self.last_positions = sorted({t.prompt_position for t in out})
    self.ledger.consume(self.last_positions)
    if self.run_dir:
      append_ledger(self.run_dir, policy_version + 1, out)
    self.wait_s = time.perf_counter() - t0
    self.queue_age_s = float(np.mean(ages)) if ages else 0.0
    return out

  def metrics(self) -> dict[str, float]:
    """The take loop's metrics, the same names on every backend: ``wait_s`` (the last take's
    seconds), ``queue_age_s`` (its arrivals' mean queue age, seconds), ``dropped_stale``
    (trajectories dropped on arrival since the start) and
    ``response_tokens_{generated,trained,dropped}_mean`` (action tokens)."""
    return {"wait_s": self.wait_s, "queue_age_s": self.queue_age_s,
            "dropped_stale": float(len(self.lengths.dropped)), **self.lengths.summary()}
