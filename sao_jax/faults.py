"""Fault injection for the crash tests, and the per-step seed both sides of a resume agree on."""

from __future__ import annotations

import os
import signal

import numpy as np


def maybe_kill(point: str, step: int) -> None:
  """If ``$SAO_FAULT_KILL`` is ``"<point>:<step>"`` (point: ``rollout`` -- half a batch
  collected, ``train`` -- after the update, before it is published or saved, ``checkpoint`` --
  right after an asynchronous save started), the process SIGKILLs itself there. Unset in real
  runs."""
  if os.environ.get("SAO_FAULT_KILL") == f"{point}:{step}":
    print(f"fault injection: SIGKILL at {point} of step {step}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def env_fault_rate() -> float:
  """``$SAO_FAULT_ENV_RATE`` (probability per ``env.step`` of an injected fault, see
  ``envs/guard.GuardedEnv``) as a float; 0 when unset (real runs). Read wherever a
  ``GuardedEnv`` is built for training: the driver (thread backend) and each Ray rollout actor
  (a local Ray's actors inherit the driver's environment)."""
  return float(os.environ.get("SAO_FAULT_ENV_RATE", "0"))


def step_seed(seed: int, step: int) -> int:
  """A 31-bit seed derived from (seed, step) (numpy SeedSequence)."""
  return int(np.random.SeedSequence([int(seed), int(step)]).generate_state(1)[0] >> 1)
