"""Environment protocol used by the (multi-turn) rollout worker.

An episode for one ``Problem`` is::

    ids = env.prompt_ids(problem)                    # starts with bos
    for turn in range(env.max_turns):
        action = policy.generate(ids, stop=tokenizer.stop_ids)
        step = env.step(problem, turn, action)
        ids += action + step.observation_ids         # loss only on `action`
        if step.done:
            break                                     # reward = step.reward

``action_ids`` are the tokens the policy generated this turn *including* the
stop token that ended it (``<eos>`` or ``</tool>``), or without one if
generation hit the length limit.  ``turn`` counts from 0.  Environments are
stateless (all state is in ``problem``/``turn``/``action_ids``), so one
instance may be shared by many concurrent episodes and threads.  An
environment returns ``done=True`` no later than at ``turn == max_turns - 1``.

An environment whose state changes within an episode (``envs/workspace.py``: a
repository copy) may define ``begin_episode(problem) -> handle`` and
``end_episode(handle)``: the rollout worker calls them when a trajectory starts
and ends, and passes the handle (which has the problem's ``id``) to ``step``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, runtime_checkable

from sao_jax.data.jsonl import Problem

__all__ = ["EnvStep", "Env", "Problem"]


@dataclasses.dataclass(frozen=True)
class EnvStep:
  observation_ids: list[int]  # tokens to append after the action (empty if done)
  done: bool
  reward: float  # only meaningful when done
  info: dict[str, Any] = dataclasses.field(default_factory=dict)


@runtime_checkable
class Env(Protocol):
  max_turns: int

  def prompt_ids(self, problem: Problem) -> list[int]:  # starts with bos
    ...

  def step(self, problem: Problem, turn: int, action_ids: list[int]) -> EnvStep:
    ...
