"""The prompt ledger: a deterministic prompt stream with exactly-once accounting.

Epoch ``e`` of the stream is the permutation ``default_rng([seed, e])`` of the train problems;
position ``p`` is problem ``order(p // n)[p % n]``. Each hand-out is a ``Handout`` carrying its
position, which travels with the rollout (``Trajectory.prompt_position``) and is the only key
used to account for it: no ids are parsed from strings. A checkpoint stores the cursor (every
position below ``low`` consumed, plus the consumed positions above it); after a crash the stream
restarts at the first unconsumed position and skips consumed ones, so rollouts that were in
flight or queued are generated again and none is counted twice.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any, Iterator, Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class Handout:
  """One prompt handed to the rollout side: the problem and its ledger position."""
  problem: Any
  position: int

  @property
  def id(self) -> str:
    return str(getattr(self.problem, "id", ""))


class PromptLedger:
  """Deterministic prompt stream over ``problems`` with a ledger of consumed positions.

  Args:
    problems: the train problems (each with an ``id``).
    seed: data-order seed.
    low: every position < low is consumed (from a checkpoint; 0 for a fresh run).
    extra: consumed positions >= low (from a checkpoint).

  Raises ValueError without problems.
  """

  def __init__(self, problems: Sequence, seed: int, low: int = 0, extra: Sequence[int] = ()):
    if not problems:
      raise ValueError("the prompt ledger needs at least one train problem.")
    self.problems, self.seed = list(problems), int(seed)
    self.low = int(low)
    self.consumed = {int(p) for p in extra if int(p) >= self.low}
    self._orders: dict[int, np.ndarray] = {}
    self._handed: set[int] = set()
    self._next = self.low

  def order(self, epoch: int) -> np.ndarray:
    if epoch not in self._orders:
      self._orders[epoch] = np.random.default_rng([self.seed, epoch]).permutation(
          len(self.problems))
    return self._orders[epoch]

  def problem_at(self, position: int):
    n = len(self.problems)
    return self.problems[int(self.order(position // n)[position % n])]

  def __iter__(self) -> Iterator[Handout]:
    return self

  def __next__(self) -> Handout:
    """The next unconsumed position (skipping consumed ones), handed out."""
    while True:
      p = self._next
      self._next += 1
      if p >= self.low and p not in self.consumed:
        self._handed.add(p)
        return Handout(self.problem_at(p), p)

  def take(self, n: int) -> list[Handout]:
    """The next ``n`` hand-outs."""
    return [next(self) for _ in range(n)]

  def consume(self, positions: Sequence[int]) -> None:
    """Marks the given handed-out positions consumed.

    Raises ValueError for a position that was never handed out or is consumed twice (the
    never-counted-twice guarantee)."""
    for p in (int(p) for p in positions):
      if p < self.low or p in self.consumed:
        raise ValueError(f"prompt position {p} is consumed twice.")
      if p not in self._handed:
        raise ValueError(f"prompt position {p} was never handed out by the ledger.")
      self._handed.discard(p)
      self.consumed.add(p)
    while self.low in self.consumed:
      self.consumed.discard(self.low)
      self.low += 1

  def state(self) -> dict:
    """JSON-serialisable cursor: ``{"low": int, "extra": sorted list, "seed": int}``."""
    return {"low": self.low, "extra": sorted(self.consumed), "seed": self.seed}

  @classmethod
  def from_state(cls, problems, state: dict) -> "PromptLedger":
    return cls(problems, state["seed"], state["low"], state["extra"])


def append_ledger(run_dir: str, step: int, trajectories: Sequence) -> None:
  """Appends ``{"step", "problem_ids", "positions", "tokens_sha1"}`` to ``run_dir/ledger.jsonl``
  (one entry per prompt; the digest covers every trajectory's tokens, log-probs and reward, in
  batch order)."""
  h = hashlib.sha1()
  for t in trajectories:
    h.update(np.asarray(t.tokens, np.int32).tobytes())
    h.update(np.asarray(t.logprobs, np.float32).tobytes())
    h.update(np.float64(t.reward).tobytes())
  firsts = {}
  for t in trajectories:
    firsts.setdefault(t.prompt_position, t)
  with open(os.path.join(run_dir, "ledger.jsonl"), "a", encoding="utf-8") as f:
    f.write(json.dumps({"step": int(step),
                        "problem_ids": [str(t.problem_id) for t in firsts.values()],
                        "positions": [int(p) for p in firsts],
                        "tokens_sha1": h.hexdigest()}) + "\n")
