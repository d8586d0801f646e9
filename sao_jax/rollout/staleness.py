"""Bounding policy lag between rollout and training: admission control and drop-on-arrival.

``staleness`` of an action token = the trainer's ``policy_version`` when it trains on the token
minus the ``policy_version`` that sampled it. A trajectory's staleness is that of its oldest
action token. Two policies bound it (both optional, both may be combined):

* **admission control** (AReaL, Fu et al. 2025, §5 "staleness-aware training"): a rollout worker
  does not *start* a new rollout when ``accepted + running`` would exceed
  ``(current_version + max_staleness + 1) × batch_size``, where ``accepted`` counts every
  trajectory accepted so far (cumulative, unit: one rollout) and ``running`` the rollouts in
  flight. Relative to what the trainer has consumed (``current_version × batch_size``) this is
  "at most ``(max_staleness + 1) × batch`` accepted-but-untrained plus running rollouts". It
  bounds the *amount* of off-policy data and never throws work away; it does not bound one
  straggler's staleness when later rollouts overtake it (in-flight updates, long tails).
* **drop-on-arrival** (GLM-5 style): when the trainer takes a trajectory, it is dropped if
  ``current_version − oldest_version > max_staleness``. Exact bound on per-token staleness, but it
  throws away the slow (long) rollouts first: training is biased toward short responses.
  ``simulate`` measures that bias (trained vs generated response-length histograms).

Counters (``StalenessStats``): accepted / dropped, a staleness histogram (trajectory and token
level) and queue age in seconds.
"""

from __future__ import annotations

import collections
import dataclasses
import queue as queue_lib
import threading
import time
from typing import Callable, Optional, Sequence

import numpy as np
from sao_jax.rollout.trajectory import Trajectory

POLICIES = ("none", "admission", "drop", "admission+drop")


def check_policy(policy: str, max_staleness: Optional[int]) -> None:
  """Validates ``rollout.staleness_policy`` / ``rollout.max_staleness``; raises ValueError."""
  if policy not in POLICIES:
    raise ValueError(f"rollout.staleness_policy={policy!r}; use one of {POLICIES}.")
  if policy != "none" and (max_staleness is None or max_staleness < 0):
    raise ValueError(f"rollout.staleness_policy={policy!r} needs rollout.max_staleness >= 0, "
                     f"got {max_staleness}.")


class AdmissionControl:
  """AReaL's admission rule (unit: one rollout). Thread-safe; shared by all rollout workers.

  Args:
    max_staleness: eta >= 0 (versions).
    batch_size: trajectories per policy step (B >= 1).

  ``try_start(version)`` returns True and counts one running rollout iff
  ``accepted + running + 1 <= (version + max_staleness + 1) * batch_size``; ``finish(accepted)``
  ends one (``accepted=False`` for a rollout that failed or was dropped, which frees its place).
  """

  def __init__(self, max_staleness: int, batch_size: int):
    if max_staleness < 0:
      raise ValueError(f"rollout.max_staleness must be >= 0, got {max_staleness}.")
    if batch_size < 1:
      raise ValueError(f"train.batch_size must be >= 1, got {batch_size}.")
    self.max_staleness, self.batch_size = int(max_staleness), int(batch_size)
    self._lock = threading.Lock()
    self.accepted = 0
    self.running = 0
    self.refused = 0

  def capacity(self, version: int) -> int:
    """Rollouts that may still start at trainer version ``version``."""
    with self._lock:
      return (version + self.max_staleness + 1) * self.batch_size - self.accepted - self.running

  def try_start(self, version: int) -> bool:
    with self._lock:
      ok = self.accepted + self.running + 1 <= (version + self.max_staleness + 1) * self.batch_size
      if ok:
        self.running += 1
      else:
        self.refused += 1
      return ok

  def finish(self, accepted: bool = True) -> None:
    with self._lock:
      if self.running <= 0:
        raise RuntimeError("AdmissionControl.finish called more often than try_start.")
      self.running -= 1
      self.accepted += int(accepted)

  def revoke(self) -> None:
    """Un-counts one accepted rollout that the trainer then dropped (drop-on-arrival), so that
    dropped work does not use up admission places for good (which would deadlock)."""
    with self._lock:
      if self.accepted <= 0:
        raise RuntimeError("AdmissionControl.revoke called with nothing accepted.")
      self.accepted -= 1


def is_too_stale(trajectory, current_version: int, max_staleness: int) -> bool:
  """Drop-on-arrival test: ``current_version - trajectory.oldest_version() > max_staleness``.

  A trajectory without action tokens (oldest version -1) is never too stale."""
  oldest = trajectory.oldest_version()
  return oldest >= 0 and current_version - oldest > max_staleness


@dataclasses.dataclass
class StalenessStats:
  """Counters for the trainer side: accepted / dropped trajectories, staleness histograms
  (versions; trajectory = its oldest token, token = every action token), queue age (s) and
  response lengths (action tokens) of accepted and dropped trajectories."""
  accepted: int = 0
  dropped: int = 0
  trajectory_staleness: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  token_staleness: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  queue_age_sum_s: float = 0.0
  queue_age_max_s: float = 0.0
  accepted_lengths: list = dataclasses.field(default_factory=list)
  dropped_lengths: list = dataclasses.field(default_factory=list)
  keep_lengths: bool = True

  def record(self, trajectory, current_version: int, queue_age_s: float, accepted: bool) -> None:
    n = trajectory.num_action_tokens
    if accepted:
      self.accepted += 1
      v = trajectory.policy_version[trajectory.action_mask > 0]
      if v.size:
        self.trajectory_staleness[int(current_version - v.min())] += 1
        vals, counts = np.unique(current_version - v, return_counts=True)
        for s, c in zip(vals.tolist(), counts.tolist()):
          self.token_staleness[int(s)] += int(c)
      self.queue_age_sum_s += queue_age_s
      self.queue_age_max_s = max(self.queue_age_max_s, queue_age_s)
      if self.keep_lengths:
        self.accepted_lengths.append(n)
    else:
      self.dropped += 1
      if self.keep_lengths:
        self.dropped_lengths.append(n)

  def summary(self) -> dict:
    """Flat float metrics: accepted, dropped, drop_fraction, staleness max/mean, queue age."""
    tot = sum(self.token_staleness.values())
    return {
        "accepted": float(self.accepted), "dropped": float(self.dropped),
        "drop_fraction": self.dropped / max(self.accepted + self.dropped, 1),
        "trajectory_staleness_max": float(max(self.trajectory_staleness, default=0)),
        "token_staleness_mean": (sum(k * c for k, c in self.token_staleness.items()) / tot
                                 if tot else 0.0),
        "queue_age_mean_s": self.queue_age_sum_s / max(self.accepted, 1),
        "queue_age_max_s": self.queue_age_max_s,
    }


def take_batch(traj_queue, n: int, current_version: int, *, policy: str = "none",
               max_staleness: Optional[int] = None, stats: Optional[StalenessStats] = None,
               admission: Optional[AdmissionControl] = None,
               on_empty: Optional[Callable[[], None]] = None, poll_s: float = 1.0):
  """Takes ``n`` trajectories from a ``TrajectoryQueue``, dropping too-stale ones on arrival when
  ``policy`` includes "drop".

  Returns (trajectories, wait seconds, mean queue age seconds). ``on_empty`` is called after
  every ``poll_s`` without an item (raise from it to abort, e.g. when the rollout side died).
  With ``admission`` given (policy "admission+drop"), a dropped trajectory is revoked from
  its accepted count (``AdmissionControl.revoke``).
  """
  check_policy(policy, max_staleness)
  out, ages = [], []
  t0 = time.perf_counter()
  while len(out) < n:
    try:
      traj, age = traj_queue.get(timeout=poll_s)
    except queue_lib.Empty:
      if on_empty is not None:
        on_empty()
      continue
    drop = "drop" in policy and is_too_stale(traj, current_version, max_staleness)
    if stats is not None:
      stats.record(traj, current_version, age, accepted=not drop)
    if admission is not None and drop:
      admission.revoke()
    if not drop:
      out.append(traj)
      ages.append(age)
  return out, time.perf_counter() - t0, float(np.mean(ages)) if ages else 0.0


def length_histogram(lengths: Sequence[int], edges: Sequence[int]) -> np.ndarray:
  """Fraction of ``lengths`` per bin ``[edges[i], edges[i+1])`` (float64 [len(edges) - 1])."""
  counts, _ = np.histogram(np.asarray(lengths), bins=np.asarray(edges))
  return counts / max(counts.sum(), 1)


@dataclasses.dataclass
class SimResult:
  """What ``simulate`` measured. Lengths are action tokens per trajectory."""
  generated_lengths: list
  trained_lengths: list
  max_queue: int
  max_token_staleness: int
  max_running: int
  stats: StalenessStats
  steps: int


def simulate(policy: str, max_staleness: Optional[int], *, lengths: np.ndarray, slots: int,
             batch_size: int, queue_size: int, train_ticks: int, steps: int) -> SimResult:
  """Discrete-time model of continuous-batching rollout feeding one trainer (no model: one tick =
  one generate step of every busy slot; each trajectory needs ``lengths[i]`` ticks).

  Rollouts start in order ``lengths[0], lengths[1], ...`` when a slot is free (and admission
  allows). Each generated token records the current policy version (in-flight weight updates).
  A finished rollout is put on a queue of ``queue_size`` (its slot stays blocked while the queue
  is full: backpressure). The trainer takes ``batch_size`` trajectories (dropping too-stale ones
  on arrival under "drop"), trains ``train_ticks`` ticks, then publishes version + 1. Uses the
  real ``AdmissionControl``, ``is_too_stale`` and ``StalenessStats``.

  Args: lengths int [N] response lengths (>= 1) of the rollouts in start order.
  Returns a ``SimResult`` after ``steps`` policy steps (or when ``lengths`` runs out).
  """
  check_policy(policy, max_staleness)
  admission = AdmissionControl(max_staleness, batch_size) if "admission" in policy else None
  stats = StalenessStats()
  version, next_i, tick = 0, 0, 0
  running: list[Optional[list]] = [None] * slots     # [length, versions list, finished?]
  q: collections.deque = collections.deque()
  generated, trained = [], []
  max_queue = max_running = max_stale = 0
  batch: list = []
  train_left = 0
  while version < steps:
    # trainer
    if train_left > 0:
      train_left -= 1
      if train_left == 0:
        trained.extend(t.num_action_tokens for t in batch)
        for t in batch:
          v = t.policy_version
          max_stale = max(max_stale, int(version - v.min()))
        batch = []
        version += 1
    if train_left == 0:
      while q and len(batch) < batch_size:
        t = q.popleft()
        drop = "drop" in policy and is_too_stale(t, version, max_staleness)
        stats.record(t, version, 0.0, accepted=not drop)
        if drop and admission is not None:
          admission.revoke()
        if not drop:
          batch.append(t)
      if len(batch) == batch_size:
        train_left = train_ticks
    # rollout side: finish / enqueue, admit, generate one token per busy slot
    for i, r in enumerate(running):
      if r is not None and len(r[1]) >= r[0]:
        if len(q) < queue_size:
          n = r[0]
          q.append(Trajectory("", np.zeros(n, np.int32), np.ones(n, np.float32),
                              np.zeros(n, np.float32), np.asarray(r[1], np.int32), 0.0))
          generated.append(n)
          if admission is not None:
            admission.finish(accepted=True)
          running[i] = None
    for i, r in enumerate(running):
      if r is None and next_i < len(lengths):
        if admission is not None and not admission.try_start(version):
          break
        running[i] = [int(lengths[next_i]), []]
        next_i += 1
    busy = [r for r in running if r is not None]
    if not busy and next_i >= len(lengths) and not q and train_left == 0:
      break
    for r in busy:
      if len(r[1]) < r[0]:
        r[1].append(version)
    max_queue = max(max_queue, len(q))
    max_running = max(max_running, len(busy))
    tick += 1
  return SimResult(generated, trained, max_queue, max_stale, max_running, stats, version)
