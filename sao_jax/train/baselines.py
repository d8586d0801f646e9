"""Stateful running-mean reward baselines (critic-free advantage estimators).

This module keeps the windows of recent rewards (host state); the advantage ``reward - baseline``
is the kernel ``sao_jax.algo.baseline_advantages``.
"""

from __future__ import annotations

import collections
from typing import Hashable, Sequence

import numpy as np



class RunningMeanBaseline:
  """Baseline = mean of the last ``window`` rewards (per key, or one global window); the
  advantage is ``reward - baseline`` (``algo.baseline_advantages``, in the learner's step).

  Each reward is scored against the window *before* it is added (a reward never baselines
  itself); trajectories of one batch are processed in order. An empty window has baseline 0
  (the advantage is then the reward itself), so the ablation is only an ablation when prompts
  recur: ``__call__`` reports which rows had a non-empty window.

  Source: SAO paper, running-mean baseline ablation (last 8 rewards of the same prompt) and the
  online experiment's baseline (global mean over the last 128 rewards).

  Args:
    window: number of recent rewards kept (>= 1).
    per_key: True = one window per key (prompt id); False = one global window.

  Raises:
    ValueError if ``window`` < 1.
  """

  def __init__(self, window: int, per_key: bool = True):
    if window < 1:
      raise ValueError(f"train.baseline_window must be >= 1, got {window}.")
    self.window, self.per_key = int(window), per_key
    self._windows: dict = collections.defaultdict(lambda: collections.deque(maxlen=self.window))

  def __call__(self, keys: Sequence[Hashable],
               rewards: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    """(baselines float32 [B], non-empty bool [B]) for ``rewards`` [B] against the windows as
    they were, then adds the rewards to the windows. Raises ValueError on a length mismatch."""
    if len(keys) != len(rewards):
      raise ValueError(f"got {len(keys)} keys for {len(rewards)} rewards.")
    baselines = np.zeros((len(rewards),), np.float32)
    nonempty = np.zeros((len(rewards),), bool)
    for i, (k, r) in enumerate(zip(keys, rewards)):
      win = self._windows[k if self.per_key else None]
      if win:
        baselines[i], nonempty[i] = float(np.mean(win)), True
      win.append(float(r))
    return baselines, nonempty
