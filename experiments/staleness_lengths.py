"""Response-length histograms of generated vs trained trajectories under each staleness policy
(long-tailed lognormal lengths; ``simulate``, a discrete-time model of continuous-batching rollout
over the package's ``AdmissionControl`` and drop rule). Writes ``runs/staleness_lengths.csv`` and
prints a table. ``python experiments/staleness_lengths.py``."""

import collections
import csv
import dataclasses
import os
import sys
from typing import Optional, Sequence

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from sao_jax.rollout.staleness import AdmissionControl, check_policy, is_too_stale  # noqa: E402
from sao_jax.rollout.trajectory import Trajectory  # noqa: E402

EDGES = [1, 8, 16, 32, 64, 128, 1001]


def length_histogram(lengths: Sequence[int], edges: Sequence[int]) -> np.ndarray:
  """Fraction of ``lengths`` per bin ``[edges[i], edges[i+1])`` (float64 [len(edges) - 1])."""
  counts, _ = np.histogram(np.asarray(lengths), bins=np.asarray(edges))
  return counts / max(counts.sum(), 1)


@dataclasses.dataclass
class SimResult:
  """What ``simulate`` measured. Lengths are action tokens per trajectory."""
  generated_lengths: list
  trained_lengths: list
  max_queue: int
  max_token_staleness: int
  max_running: int
  dropped: int
  steps: int


def simulate(policy: str, max_staleness: Optional[int], *, lengths: np.ndarray, slots: int,
             batch_size: int, queue_size: int, train_ticks: int, steps: int) -> SimResult:
  """Discrete-time model of continuous-batching rollout feeding one trainer (no model: one tick =
  one generate step of every busy slot; each trajectory needs ``lengths[i]`` ticks).

  Rollouts start in order ``lengths[0], lengths[1], ...`` when a slot is free (and admission
  allows). Each generated token records the current policy version (in-flight weight updates).
  A finished rollout is put on a queue of ``queue_size`` (its slot stays blocked while the queue
  is full: backpressure). The trainer takes ``batch_size`` trajectories (dropping too-stale ones
  on arrival under "drop"), trains ``train_ticks`` ticks, then publishes version + 1. Uses the
  package's ``AdmissionControl`` and ``is_too_stale``.

  Args: lengths int [N] response lengths (>= 1) of the rollouts in start order.
  Returns a ``SimResult`` after ``steps`` policy steps (or when ``lengths`` runs out).
  """
  check_policy(policy, max_staleness)
  admission = AdmissionControl(max_staleness, batch_size) if "admission" in policy else None
  dropped = 0
  version, next_i, tick = 0, 0, 0
  running: list[Optional[list]] = [None] * slots     # [length, versions list, finished?]
  q: collections.deque = collections.deque()
  generated, trained = [], []
  max_queue = max_running = max_stale = 0
  batch: list = []
  train_left = 0
  while version < steps:
    # trainer
    if train_left > 0:
      train_left -= 1
      if train_left == 0:
        trained.extend(t.num_action_tokens for t in batch)
        for t in batch:
          v = t.policy_version
          max_stale = max(max_stale, int(version - v.min()))
        batch = []
        version += 1
    if train_left == 0:
      while q and len(batch) < batch_size:
        t = q.popleft()
        drop = "drop" in policy and is_too_stale(t, version, max_staleness)
        dropped += int(drop)
        if drop and admission is not None:
          admission.revoke()
        if not drop:
          batch.append(t)
      if len(batch) == batch_size:
        train_left = train_ticks
    # rollout side: finish / enqueue, admit, generate one token per busy slot
    for i, r in enumerate(running):
      if r is not None and len(r[1]) >= r[0]:
        if len(q) < queue_size:
          n = r[0]
          q.append(Trajectory("", np.zeros(n, np.int32), np.ones(n, np.float32),
                              np.zeros(n, np.float32), np.asarray(r[1], np.int32), 0.0))
          generated.append(n)
          if admission is not None:
            admission.finish(accepted=True)
          running[i] = None
    for i, r in enumerate(running):
      if r is None and next_i < len(lengths):
        if admission is not None and not admission.try_start(version):
          break
        running[i] = [int(lengths[next_i]), []]
        next_i += 1
    busy = [r for r in running if r is not None]
    if not busy and next_i >= len(lengths) and not q and train_left == 0:
      break
    for r in busy:
      if len(r[1]) < r[0]:
        r[1].append(version)
    max_queue = max(max_queue, len(q))
    max_running = max(max_running, len(busy))
    tick += 1
  return SimResult(generated, trained, max_queue, max_stale, max_running, dropped, version)


def main():
  lengths = np.clip(np.round(np.random.default_rng(0).lognormal(3.0, 1.0, 40000)), 1, 1000)
  rows = []
  for policy in ("none", "admission", "drop", "admission+drop"):
    r = simulate(policy, None if policy == "none" else 1, lengths=lengths.astype(int), slots=32,
                 batch_size=16, queue_size=24, train_ticks=20, steps=200)
    for kind, ls in (("generated", r.generated_lengths), ("trained", r.trained_lengths)):
      h = length_histogram(ls, EDGES)
      rows.append([policy, kind, len(ls), f"{np.mean(ls):.1f}", r.max_token_staleness,
                   r.dropped] + [f"{x:.3f}" for x in h])
  head = ["policy", "set", "n", "mean_len", "max_staleness", "dropped"] + [
      f"[{a},{b})" for a, b in zip(EDGES[:-1], EDGES[1:])]
  os.makedirs("runs", exist_ok=True)
  with open("runs/staleness_lengths.csv", "w", newline="", encoding="utf-8") as f:
    csv.writer(f).writerows([head] + rows)
  print(" ".join(f"{h:>14s}" for h in head))
  for row in rows:
    print(" ".join(f"{str(x):>14s}" for x in row))


if __name__ == "__main__":
  main()
