r"""Single-turn math environment (e.g. AIME): answer in ``\boxed{}``.

Prompt text: ``problem.prompt + "\nPut the final answer in \\boxed{}.\n"``,
tokenized with ``tokenizer.encode`` and prefixed with ``bos_id`` (unless the
tokenizer already put it there).  The episode ends after the first turn with
``reward = grade(tokenizer.decode(action_ids), problem.answer)``.

Works with ``CharTokenizer`` or any tokenizer exposing ``encode(text)``,
``decode(ids)`` and ``bos_id`` (``stop_ids``/``eos_id`` are optional and only
used to fill ``info["truncated"]``).  A truncated response (no stop token) is
still graded: a box written before the cut counts.
"""

from __future__ import annotations

from typing import Sequence

from sao_jax.data.jsonl import Problem
from sao_jax.envs.base import EnvStep
from sao_jax.envs.grading import extract_boxed, grade

INSTRUCTION = "\nPut the final answer in \\boxed{}.\n"


class MathEnv:
  """Single-turn boxed-answer environment (``max_turns`` is informational:
  every episode ends after its first step)."""

  def __init__(self, tokenizer, max_turns: int = 1):
    if max_turns < 1:
      raise ValueError(f"max_turns must be >= 1, got {max_turns}")
    self.tokenizer = tokenizer
    self.max_turns = int(max_turns)

  def prompt_text(self, problem: Problem) -> str:
    return problem.prompt + INSTRUCTION

  def prompt_ids(self, problem: Problem) -> list[int]:
    ids = [int(i) for i in self.tokenizer.encode(self.prompt_text(problem))]
    bos = self.tokenizer.bos_id
    if bos is not None and (not ids or ids[0] != bos):
      ids.insert(0, int(bos))
    return ids

  def _stop_ids(self) -> tuple[int, ...]:
    stop = getattr(self.tokenizer, "stop_ids", None)
    if stop is None:
      eos = getattr(self.tokenizer, "eos_id", None)
      if eos is None:
        eos = getattr(self.tokenizer, "eos_token_id", None)
      stop = () if eos is None else (eos,)
    return tuple(int(s) for s in stop)

  def response_prefix(self, problem: Problem) -> str:
    """Text the prompt ends with, graded as the response's start ("" here; ChatMathEnv)."""
    del problem
    return ""

  def step(self, problem: Problem, turn: int, action_ids: Sequence[int]) -> EnvStep:
    ids = [int(t) for t in action_ids]
    try:
      text = self.response_prefix(problem) + self.tokenizer.decode(ids)
    except Exception:
      text = self.response_prefix(problem)
    stop = self._stop_ids()
    truncated = not ids or (bool(stop) and ids[-1] not in stop)
    info = {
        "tool_calls": 0,
        "truncated": truncated,
        "answer": extract_boxed(text),
    }
    return EnvStep(observation_ids=[], done=True, reward=grade(text, problem.answer), info=info)
