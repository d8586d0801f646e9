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
  throws away the slow (long) rollouts first: training is biased toward short responses
  (``experiments/staleness_lengths.py`` simulates that bias).

Both are applied by ``rollout.assembler.BatchAssembler``, the take loop of every source.
"""

from __future__ import annotations

import threading
from typing import Optional

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
