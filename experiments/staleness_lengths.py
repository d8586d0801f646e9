"""Response-length histograms of generated vs trained trajectories under each staleness policy
(long-tailed lognormal lengths; ``sao_jax.rollout.staleness.simulate``). Writes
``runs/staleness_lengths.csv`` and prints a table. ``python experiments/staleness_lengths.py``."""

import csv
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from sao_jax.rollout.staleness import length_histogram, simulate  # noqa: E402

EDGES = [1, 8, 16, 32, 64, 128, 1001]


def main():
  lengths = np.clip(np.round(np.random.default_rng(0).lognormal(3.0, 1.0, 40000)), 1, 1000)
  rows = []
  for policy in ("none", "admission", "drop", "admission+drop"):
    r = simulate(policy, None if policy == "none" else 1, lengths=lengths.astype(int), slots=32,
                 batch_size=16, queue_size=24, train_ticks=20, steps=200)
    for kind, ls in (("generated", r.generated_lengths), ("trained", r.trained_lengths)):
      h = length_histogram(ls, EDGES)
      rows.append([policy, kind, len(ls), f"{np.mean(ls):.1f}", r.max_token_staleness,
                   r.stats.dropped] + [f"{x:.3f}" for x in h])
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
