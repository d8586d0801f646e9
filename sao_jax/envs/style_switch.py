r"""Online-learning task (paper §4.5 analogue): the tool-integrated arithmetic task whose
*preferred output style* switches between phases, like the paper's cute -> chuunibyou ->
classical persona switch.

Styles are the character right after the final ``\boxed{...}``: ``STYLES = ("", "!", "~")``
(plain, exclaimed, tilde), e.g. ``\boxed{9945}!<eos>``. Reward = (the boxed answer is correct,
graded by ``ArithToolEnv``) x (the style is the current phase's preferred one); 0/1.

Phase: ``(completed episodes // switch_every_episodes) % 3`` -- a thread-safe counter of finished
episodes (the rollout worker is asynchronous, so the phase follows *generated* episodes, which run
a little ahead of the trainer's policy steps; with ``switch_every_episodes = N * batch_size`` the
phase switches about every N policy steps). Preferred style of phase p: ``STYLES[p % 3]``.

The warm-up demonstrations use the tool (w.p. ``p_tool``) and a uniformly random style, so the
warm-started policy writes each style about a third of the time.
"""

from __future__ import annotations

import threading
from typing import Sequence

import numpy as np

from sao_jax.data.jsonl import Problem
from sao_jax.envs import arith_tool
from sao_jax.envs.base import EnvStep

STYLES: tuple[str, ...] = ("", "!", "~")


def style_of(text: str) -> int:
  """Index into ``STYLES`` of an answer text (``<eos>``/specials already stripped): the text after
  the last ``}``; -1 when it is none of the styles (or there is no ``}``)."""
  i = text.rfind("}")
  if i < 0:
    return -1
  tail = text[i + 1:]
  return STYLES.index(tail) if tail in STYLES else -1


class StyleSwitchEnv(arith_tool.ArithToolEnv):
  """``ArithToolEnv`` whose final reward also requires the current phase's style (module doc).

  Args: tokenizer (CharTokenizer), max_turns, switch_every_episodes (int > 0: episodes per
  phase). Raises ValueError for switch_every_episodes < 1."""

  def __init__(self, tokenizer, max_turns: int = 3, switch_every_episodes: int = 256):
    super().__init__(tokenizer, max_turns=max_turns)
    if switch_every_episodes < 1:
      raise ValueError(f"task.switch_every must be >= 1 (policy steps per phase), got "
                       f"switch_every_episodes={switch_every_episodes}")
    self.switch_every_episodes = int(switch_every_episodes)
    self._lock = threading.Lock()
    self.episodes = 0

  def phase(self) -> int:
    """Current phase (0, 1, 2, 3, ...); the preferred style is ``STYLES[phase % 3]``."""
    return self.episodes // self.switch_every_episodes

  def step(self, problem: Problem, turn: int, action_ids: Sequence[int]) -> EnvStep:
    st = super().step(problem, turn, action_ids)
    if not st.done:
      return st
    with self._lock:
      phase = self.phase()
      self.episodes += 1
    text = self.tokenizer.decode([int(t) for t in action_ids], skip_special=True)
    style = style_of(text)
    info = dict(st.info, style=style, phase=phase, correct=st.reward)
    reward = float(st.reward) * float(style == phase % len(STYLES))
    return EnvStep(observation_ids=st.observation_ids, done=True, reward=reward, info=info)


def make_sft_dataset(problems: Sequence[Problem], p_tool: float, seed: int, tokenizer,
                     p_guess_correct: float = 0.1) -> list[tuple[list[int], list[int]]]:
  """Arith demos (``arith_tool.make_demo``) with a uniformly random style character inserted
  before the final ``<eos>`` (trained on: loss mask 1)."""
  rng = np.random.default_rng(seed)
  out = []
  for problem in problems:
    ids, mask = arith_tool.make_demo(problem, bool(rng.random() < p_tool), rng, tokenizer,
                                     p_guess_correct)
    style = STYLES[int(rng.integers(len(STYLES)))]
    extra = tokenizer.encode(style)
    out.append((ids[:-1] + extra + ids[-1:], mask[:-1] + [1] * len(extra) + mask[-1:]))
  return out
