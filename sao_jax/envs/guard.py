"""``GuardedEnv``: a wall-clock timeout and a finite-reward check around any environment, and
optional fault injection (tests, the soak script).

The rollout worker already turns an exception from ``env.step`` into a failed trajectory
(``info["failed"] = True``, ``info["error"] = "<Type>: <message>"``, counted in
``WorkerStats.env_errors``); this wrapper makes a hung or NaN-returning environment raise too:
  * ``EnvTimeout`` when ``step`` takes longer than ``timeout_s`` seconds (the call runs on a
    small thread pool; a hung call's thread cannot be killed and is left to finish on its own --
    for code that may never return use the process sandbox, ``sao_jax/envs/sandbox.py``);
  * ``ValueError`` naming ``EnvStep.reward`` when a finished episode's reward is not one finite
    real number (NaN, inf, a string such as "1.0", None, an array): ``check_reward``.
"""

from __future__ import annotations

import concurrent.futures
import math
import threading
import time
from typing import Optional

import numpy as np

from sao_jax.envs.base import EnvStep


class EnvTimeout(TimeoutError):
  """``env.step`` did not return within the timeout."""


class InjectedFault(RuntimeError):
  """Raised by fault injection (``fault_rate`` > 0)."""


class GuardedEnv:
  """Wraps ``env`` (same protocol: ``max_turns``, ``prompt_ids``, ``step``).

  Args:
    env: the environment.
    timeout_s: wall-clock seconds per ``step`` call (None: no timeout).
    fault_rate: probability per ``step`` of an injected fault (0 in real runs); faults cycle
      through an exception, a hang longer than ``timeout_s`` and a NaN reward.
    seed: seed of the fault injection.
  """

  def __init__(self, env, timeout_s: Optional[float] = 30.0, fault_rate: float = 0.0,
               seed: int = 0, max_workers: int = 4):
    if timeout_s is not None and not timeout_s > 0:
      raise ValueError(f"rollout.env_timeout_s must be > 0, got {timeout_s}.")
    self.env, self.timeout_s, self.fault_rate = env, timeout_s, float(fault_rate)
    self.max_turns = env.max_turns
    self._rng = np.random.default_rng(seed)
    self._lock = threading.Lock()
    self._n_faults = 0
    self._pool = (concurrent.futures.ThreadPoolExecutor(max_workers, thread_name_prefix="env")
                  if timeout_s is not None else None)

  def __getattr__(self, name):
    return getattr(self.env, name)

  def prompt_ids(self, problem):
    return self.env.prompt_ids(problem)

  def _inner_step(self, problem, turn, action_ids, fault: Optional[str]) -> EnvStep:
    if fault == "raise":
      raise InjectedFault("injected reward/environment exception")
    if fault == "hang":
      time.sleep((self.timeout_s or 1.0) * 3)
    out = self.env.step(problem, turn, action_ids)
    if fault == "nan":
      out = EnvStep(out.observation_ids, True, float("nan"), dict(out.info))
    return out

  def step(self, problem, turn: int, action_ids) -> EnvStep:
    fault = None
    if self.fault_rate > 0:
      with self._lock:
        if self._rng.random() < self.fault_rate:
          fault = ("raise", "hang", "nan")[self._n_faults % 3]
          self._n_faults += 1
    if self._pool is None:
      out = self._inner_step(problem, turn, action_ids, fault)
    else:
      fut = self._pool.submit(self._inner_step, problem, turn, action_ids, fault)
      try:
        out = fut.result(timeout=self.timeout_s)
      except concurrent.futures.TimeoutError:
        raise EnvTimeout(f"env.step exceeded rollout.env_timeout_s={self.timeout_s}s "
                         f"(problem {getattr(problem, 'id', '?')}, turn {turn})") from None
    if out.done:  # a plain float from here on (the worker and the batch store it as is)
      out = EnvStep(out.observation_ids, True,
                    check_reward(out.reward, f"problem {getattr(problem, 'id', '?')}"), out.info)
    return out


def check_reward(reward, where: str = "", field: str = "EnvStep.reward") -> float:
  """``reward`` as a Python float if it is one finite real number: a bool, int or float, a
  NumPy / JAX scalar or a 0-d array of one. Anything else -- a string (even "1.0"), None, a
  complex number, an array of shape (2,) or (1,), NaN, inf -- raises ValueError naming ``field``
  (``EnvStep.reward`` here, ``Trajectory.reward`` at the learner, ``train/batch.py``), ``where``
  (e.g. "problem 17"), the value and what to return instead."""
  a = None
  if reward is not None and not isinstance(reward, (str, bytes)):
    try:
      a = np.asarray(reward)
    except Exception:  # pylint: disable=broad-except  (an object NumPy cannot read)
      a = None
  if a is None or a.dtype.kind not in "biuf":
    problem = f"is {type(reward).__name__} {reward!r}, not a real number"
  elif a.ndim:
    problem = f"has shape {a.shape}, not one scalar per episode"
  elif not math.isfinite(float(a)):
    problem = f"is {float(a)!r}, not finite"
  else:
    return float(a)
  raise ValueError(f"{field}{' for ' + where if where else ''} {problem}; env.step must "
                   "return one finite float (e.g. 1.0 or 0.0) as a finished episode's reward.")
