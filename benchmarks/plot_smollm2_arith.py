"""Learning curve of `configs/smollm2_arith.py` (SmolLM2-135M-Instruct, SAO, 2 CPU cores).

    python benchmarks/plot_smollm2_arith.py [--run runs/smollm2_arith]
        [--out benchmarks/results/smollm2_arith_curve.png]

Reads the run's ``metrics.jsonl`` (one ``{"step": n, key: value}`` record per step) and
``results.csv`` (``metric,value``; ``accuracy_before`` / ``accuracy_after`` on the held-out
set), and draws: the training reward per step (rollouts at ``rollout.temperature``) with a
5-step running mean; the greedy held-out accuracy before SAO (step 0), at the periodic evals
(the first ``eval.periodic_problems`` held-out problems) and after the last step (the whole
held-out set). Raises FileNotFoundError if the run folder lacks ``metrics.jsonl``.
"""

import argparse
import csv
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def load(run: str):
  """(records, summary): the metrics.jsonl records and results.csv as a dict of floats."""
  path = os.path.join(run, "metrics.jsonl")
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{path} not found: run `python -m sao_jax.main "
                            "--config=configs/smollm2_arith.py` first (or pass --run)")
  with open(path) as f:
    records = [json.loads(line) for line in f if line.strip()]
  summary = {}
  res = os.path.join(run, "results.csv")
  if os.path.isfile(res):
    with open(res) as f:
      for row in csv.reader(f):
        try:
          summary[row[0]] = float(row[1])
        except (ValueError, IndexError):
          pass
  return records, summary


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--run", default="runs/smollm2_arith")
  ap.add_argument("--out", default="benchmarks/results/smollm2_arith_curve.png")
  args = ap.parse_args()
  records, summary = load(args.run)
  cfg_path = os.path.join(args.run, "config.json")
  cfg = json.load(open(cfg_path)) if os.path.isfile(cfg_path) else {}
  periodic = cfg.get("eval", {}).get("periodic_problems", "?")
  temp = cfg.get("rollout", {}).get("temperature", "?")
  n_eval = cfg.get("task", {}).get("n_eval", "?")
  train = [r for r in records if "reward_mean" in r]
  steps = np.array([r["step"] for r in train])
  reward = np.array([r["reward_mean"] for r in train])
  fig, ax = plt.subplots(figsize=(7, 4))
  ax.plot(steps, reward, ".", color="tab:blue", alpha=0.4, label=f"train reward (T={temp} samples)")
  if len(reward) >= 5:
    run_mean = np.convolve(reward, np.ones(5) / 5, mode="valid")
    ax.plot(steps[4:], run_mean, "-", color="tab:blue", label="train reward, 5-step mean")
  ev = [(r["step"], r["eval_accuracy"]) for r in records if "eval_accuracy" in r]
  if "accuracy_before" in summary:
    ev = [(0, summary["accuracy_before"])] + ev
  if ev:
    ax.plot(*zip(*ev), "o-", color="tab:red", label=f"held-out greedy accuracy (step 0: {n_eval}; "
            f"periodic: first {periodic})")
  finals = [(r["step"], r["final/eval_accuracy"]) for r in records if "final/eval_accuracy" in r]
  n = int(summary.get("eval_problems", 0))
  if finals:
    ax.plot(*finals[-1], "s", color="darkred", ms=9,
            label=f"final held-out greedy accuracy ({n or '?'} problems)")
  if "accuracy_before" in summary:
    ax.axhline(summary["accuracy_before"], color="gray", ls=":", lw=1)
  ax.set_xlabel("SAO policy step")
  ax.set_ylabel("accuracy / reward")
  ax.set_ylim(0, 1)
  ax.set_title("SmolLM2-135M-Instruct, SAO on small-number sums (2 CPU cores)")
  ax.legend(loc="upper left", fontsize=8)
  ax.grid(alpha=0.3)
  fig.tight_layout()
  os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
  fig.savefig(args.out, dpi=120)
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
