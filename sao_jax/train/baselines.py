"""Stateful running-mean reward baselines (critic-free advantage estimators).

The pure kernel is `sao_jax.algo.running_mean_baseline_advantage`; this module only keeps the
windows of recent rewards.
"""

from __future__ import annotations

import collections
from typing import Hashable, Sequence

import numpy as np

from sao_jax import algo


class RunningMeanBaseline:
  """Advantage = reward - mean of the last ``window`` rewards (per key, or one global window).

  Each reward is scored against the window *before* it is added (a reward never baselines
  itself); trajectories of one batch are processed in order. An empty window has baseline 0.

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

  def __call__(self, keys: Sequence[Hashable], rewards: Sequence[float]) -> np.ndarray:
    """float32 [B] advantages for ``rewards`` [B]; then adds the rewards to the windows."""
    if len(keys) != len(rewards):
      raise ValueError(f"got {len(keys)} keys for {len(rewards)} rewards.")
    out = np.zeros((len(rewards),), np.float32)
    for i, (k, r) in enumerate(zip(keys, rewards)):
      win = self._windows[k if self.per_key else None]
      out[i] = float(algo.running_mean_baseline_advantage(
          np.float32(r), np.asarray(list(win), np.float32)))
      win.append(float(r))
    return out
