"""The composition root's builders shared by every path that rolls out (the thread source in
``train/setup.py``, the Ray rollout actor), so that both get the same objects from the same
typed roles (``sao_jax/roles.py``).

Only what the two rollout paths built differently lives here so far: the guarded environment
(timeout, injected fault rate, env threads) and the rollout worker's settings.
"""

from __future__ import annotations

import os

from sao_jax import roles
from sao_jax.envs.guard import GuardedEnv
from sao_jax.rollout.worker import env_workers_for


def env_fault_rate() -> float:
  """The injected env.step failure rate of a fault-injection run (``SAO_FAULT_ENV_RATE``, a
  probability in [0, 1]; 0 when unset): ``sao_jax/faults.py``'s environment switch."""
  return float(os.environ.get("SAO_FAULT_ENV_RATE", "0"))


def rollout_env(run: roles.Run, env, seed: int) -> tuple[GuardedEnv, int]:
  """(``GuardedEnv`` around the task's ``env``, its env threads): ``rollout.env_timeout_s``,
  the fault rate, ``rollout.env_workers`` resolved (``env_workers_for``)."""
  workers = env_workers_for(run)  # >0: env.step off the decode loop (slow tool calls)
  return GuardedEnv(env, timeout_s=run.rollout.env_timeout_s, fault_rate=env_fault_rate(),
                    seed=seed, max_workers=max(4, workers)), workers


def worker_kwargs(run: roles.Run) -> dict:
  """The ``RolloutWorker`` settings from ``run.rollout`` / ``run.model`` (both rollout paths)."""
  r = run.rollout
  return dict(max_new_tokens=r.max_new_tokens, max_seq_len=run.model.max_seq_len,
              temperature=r.temperature, kv_on_update=r.kv_on_update,
              decode_steps=r.decode_steps)
