r"""Online-learning task (paper §4.5 analogue): a tool-use task (``task.style_base``:
``arith_tool`` or ``chain_tool``) whose *preferred output style* switches between phases, like
the paper's cute -> chuunibyou -> classical persona switch.

Styles are the character right after the final ``\boxed{...}``: ``STYLES = ("", "!", "~")``
(plain, exclaimed, tilde), e.g. ``\boxed{9945}!<eos>``. Reward = (the boxed answer is correct,
graded by ``ArithToolEnv``) x (the style is the current phase's preferred one); 0/1.

Phase: ``(completed episodes // switch_every_episodes) % 3`` -- a thread-safe counter of finished
episodes (the rollout worker is asynchronous, so the phase follows *generated* episodes, which run
a little ahead of the trainer's policy steps; with ``switch_every_episodes = N * batch_size`` the
phase switches about every N policy steps). Preferred style of phase p: ``STYLES[p % 3]``.

The warm-up demonstrations are the base task's with a uniformly random style (``add_styles``), so
the warm-started policy writes each style about a third of the time. Once one style is rewarded,
RL drives the others' probability towards 0 and nothing can bring them back when the preference
switches (measured on ``arith_tool``, 2026-11-29: after phase 0 no run ever earned a reward
again). ``experiments/online_style.py`` therefore keeps the k3 KL to the warm-started policy on
(``train.kl_coef``): as a loss on sampled tokens its gradient is that of the forward KL(pi_ref ||
pi), which is mass-covering, so every style keeps a floor of probability (module doc there).
"""

from __future__ import annotations

import threading
from typing import Sequence

import numpy as np

from sao_jax.data.jsonl import Problem
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


class StyleSwitchEnv:
  """Wraps a tool-use environment (``ArithToolEnv``, ``ChainToolEnv``) so that the final reward
  also requires the current phase's style (module doc); every other attribute and method is the
  wrapped env's.

  Args: env (the base environment: ``step(problem, turn, action_ids) -> EnvStep`` whose final
  ``info`` carries no style), switch_every_episodes (int > 0: completed episodes per phase).
  Final-step ``info`` adds ``style`` (index into ``STYLES``, -1 = none), ``phase`` and
  ``correct`` (the base env's 0/1 reward). Raises ValueError for switch_every_episodes < 1."""

  def __init__(self, env, switch_every_episodes: int = 256):
    if switch_every_episodes < 1:
      raise ValueError(f"task.switch_every must be >= 1 (policy steps per phase), got "
                       f"switch_every_episodes={switch_every_episodes}")
    self.base = env
    self.switch_every_episodes = int(switch_every_episodes)
    self._lock = threading.Lock()
    self.episodes = 0

  def __getattr__(self, name):  # prompt_ids, tokenizer, max_turns, ... are the base env's
    if name == "base":
      raise AttributeError(name)
    return getattr(self.base, name)

  def reset_phase_clock(self) -> None:
    """Restarts phase 0 (episodes = 0); the loop calls it after value pre-training, so the
    schedule counts policy-step episodes for arms with and without a critic alike."""
    with self._lock:
      self.episodes = 0

  def phase(self) -> int:
    """Current phase (0, 1, 2, 3, ...); the preferred style is ``STYLES[phase % 3]``."""
    return self.episodes // self.switch_every_episodes

  def step(self, problem: Problem, turn: int, action_ids: Sequence[int]) -> EnvStep:
    st = self.base.step(problem, turn, action_ids)
    if not st.done:
      return st
    with self._lock:
      phase = self.phase()
      self.episodes += 1
    text = self.base.tokenizer.decode([int(t) for t in action_ids], skip_special=True)
    style = style_of(text)
    info = dict(st.info, style=style, phase=phase, correct=st.reward)
    reward = float(st.reward) * float(style == phase % len(STYLES))
    return EnvStep(observation_ids=st.observation_ids, done=True, reward=reward, info=info)


def add_styles(demos: Sequence[tuple[list[int], list[int]]], seed: int, tokenizer
               ) -> list[tuple[list[int], list[int]]]:
  """The base task's demonstrations ``(ids, loss_mask)``, each ending in ``<eos>``, with a
  uniformly random style string inserted before that ``<eos>`` (loss mask 1), so the warm-started
  policy writes each style about a third of the time. Raises ValueError for a demo that does not
  end in ``tokenizer.eos_id``."""
  rng = np.random.default_rng([seed, 7])
  out = []
  for ids, mask in demos:
    if not ids or ids[-1] != tokenizer.eos_id:
      raise ValueError("style_switch: every base demonstration must end in <eos>; got one "
                       f"ending in token {ids[-1] if ids else None}")
    extra = tokenizer.encode(STYLES[int(rng.integers(len(STYLES)))])
    out.append((list(ids[:-1]) + extra + list(ids[-1:]),
                list(mask[:-1]) + [1] * len(extra) + list(mask[-1:])))
  return out


def batch_metrics(trajs) -> dict[str, float]:
  """Which style a policy step's trajectories wrote: ``style{k}_fraction`` for k in 0..2 (their
  final ``info["style"]``) and ``correct_mean`` (the base task's reward, style ignored)."""
  styles = np.array([t.info.get("style", -1) for t in trajs])
  out = {f"style{k}_fraction": float(np.mean(styles == k)) for k in range(len(STYLES))}
  out["correct_mean"] = float(np.mean([t.info.get("correct", 0.0) for t in trajs]))
  return out
