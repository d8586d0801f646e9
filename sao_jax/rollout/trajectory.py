"""The ``Trajectory`` record the rollout side emits (the learner builds its ``Batch`` from it)."""

from __future__ import annotations

import dataclasses
import numpy as np


@dataclasses.dataclass
class Trajectory:
  """One rollout of one prompt (SAO: exactly one per prompt).

  All per-token arrays have length L = prompt + response tokens and are indexed like ``tokens``.

  Attributes:
    problem_id: dataset id of the prompt.
    tokens: int32 [L] prompt, actions and observations, in order.
    action_mask: float32 [L] 1 on tokens the policy sampled, 0 on prompt and observation tokens.
    logprobs: float32 [L] log-prob the inference engine recorded when sampling each action token
      (0 elsewhere) -- ``logp_rollout`` of DIS.
    policy_version: int32 [L] policy version whose weights sampled each action token (-1 elsewhere).
    reward: scalar outcome reward (placed on the last action token by the trainer).
    num_turns: number of policy turns.
    truncated: True if the trajectory hit a length limit instead of ending by itself.
    info: environment info (tool calls, extracted answer, failure reason ...).
    t_start, t_end: wall-clock seconds (time.time()) of admission and completion.
    prompt_position: the prompt ledger position this rollout answers (unique per hand-out;
      the members of one GRPO group share it); -1 outside the ledger (evaluation).
  """

  problem_id: str
  tokens: np.ndarray
  action_mask: np.ndarray
  logprobs: np.ndarray
  policy_version: np.ndarray
  reward: float
  num_turns: int = 1
  truncated: bool = False
  info: dict = dataclasses.field(default_factory=dict)
  t_start: float = 0.0
  t_end: float = 0.0
  prompt_position: int = -1

  @property
  def num_action_tokens(self) -> int:
    return int(self.action_mask.sum())

  def oldest_version(self) -> int:
    v = self.policy_version[self.action_mask > 0]
    return int(v.min()) if v.size else -1


def bucket_length(n: int, multiple: int = 32) -> int:
  """Rounds ``n`` up to a multiple of ``multiple`` (limits the number of compiled shapes)."""
  return max(multiple, -(-n // multiple) * multiple)
