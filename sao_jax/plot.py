"""PNG dashboard of a run: ``python -m sao_jax.plot RUN_DIR [--out PATH]``.

Reads ``RUN_DIR/metrics.jsonl`` (written by every run, see ``sao_jax/train/metrics.py``) and
writes ``RUN_DIR/plots/dashboard.png`` with six panels, one per question a researcher asks:

  1. is it learning?          reward per batch (+ moving average), held-out greedy accuracy
  2. is the critic useful?    explained variance (and value loss)
  3. how much does DIS mask?  masked fraction, split into low / high side of the band
  4. how stale are tokens?    histogram of token staleness (versions) over the whole run
  5. how fast?                rollout tokens per second
  6. where does time go?      per policy step: trainer waiting for rollouts vs training

Metric names, units and meanings come from ``sao_jax/train/metric_defs.py``. If the same run
folder was used by several runs (``metrics.jsonl`` is appended to), only the last run is plotted
(a new run is detected where the step counter goes back).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional, Sequence

import numpy as np

from sao_jax.train.metric_defs import PREFIXES
import csv


def load_records(run_dir: str) -> list[dict]:
  """Records of the last run in ``run_dir/metrics.jsonl``, in file order.

  Raises FileNotFoundError naming the file and the command that creates it, ValueError naming
  the line of a malformed record."""
  path = os.path.join(run_dir, "metrics.jsonl")
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{path} does not exist: RUN_DIR must be a run folder written by "
                            "`python -m sao_jax.main --config=...` (config field run_dir, "
                            "e.g. runs/arith_tool).")
  records = []
  with open(path, encoding="utf-8") as f:
    for i, line in enumerate(f, 1):
      if line.strip():
        try:
          records.append(json.loads(line))
        except json.JSONDecodeError as e:
          raise ValueError(f"{path}:{i}: not a JSON record ({e.msg}).") from None
  return last_run(records)


def _is_train(rec: dict) -> bool:
  return not any(k.startswith(PREFIXES) for k in rec)


def last_run(records: Sequence[dict]) -> list[dict]:
  """The records after the last place where the training step counter goes back (a new run
  appended to the same file). Prefixed records (``critic_warmup/``, ``final/``) do not count."""
  start, prev = 0, None
  for i, r in enumerate(records):
    if _is_train(r) and "step" in r:
      if prev is not None and r["step"] < prev:
        start = i
        while start > 0 and any(k.startswith("critic_warmup/") for k in records[start - 1]):
          start -= 1  # critic warm-up records of the new run belong to it
      prev = r["step"]
  return list(records[start:])


def series(records: Sequence[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
  """(steps int64 [n], values float64 [n]) of the records that have a finite numeric ``key``."""
  steps, vals = [], []
  for r in records:
    v = r.get(key)
    if isinstance(v, (int, float)) and not isinstance(v, bool) and np.isfinite(v):
      steps.append(int(r["step"]))
      vals.append(float(v))
  return np.asarray(steps, np.int64), np.asarray(vals, np.float64)


def staleness_histogram(records: Sequence[dict]) -> np.ndarray:
  """Action tokens per staleness over the run: int64 [max_staleness + 1], the sum of every
  record's ``staleness_hist`` list (shorter lists are zero-padded). Empty if none logged it."""
  hists = [np.asarray(r["staleness_hist"], np.int64) for r in records
           if isinstance(r.get("staleness_hist"), list) and r["staleness_hist"]]
  if not hists:
    return np.zeros((0,), np.int64)
  out = np.zeros((max(h.size for h in hists),), np.int64)
  for h in hists:
    out[:h.size] += h
  return out


def moving_average(x: np.ndarray, window: int) -> np.ndarray:
  """Trailing mean over the last ``window`` values (fewer at the start); same shape as ``x``."""
  x = np.asarray(x, np.float64)
  if x.size == 0:
    return x
  c = np.cumsum(np.insert(x, 0, 0.0))
  idx = np.arange(1, x.size + 1)
  lo = np.maximum(idx - window, 0)
  return (c[idx] - c[lo]) / (idx - lo)


def _results(run_dir: str) -> dict:
  path = os.path.join(run_dir, "results.csv")
  if not os.path.isfile(path):
    return {}
  with open(path, encoding="utf-8") as f:
    rows = list(csv.reader(f))
  return {r[0]: r[1] for r in rows[1:] if len(r) == 2}


def _empty(ax, what: str):
  ax.text(0.5, 0.5, f"no {what} logged", ha="center", va="center", transform=ax.transAxes,
          color="0.4", fontsize=12)


def dashboard(records: Sequence[dict], title: str = "", results: Optional[dict] = None):
  """A matplotlib Figure (3 x 2 panels, 15 x 13 inches) for ``records``; see the module doc."""
  import matplotlib  # pylint: disable=import-outside-toplevel  (matplotlib loads only when a plot is drawn)
  matplotlib.use("Agg", force=False)
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel  (matplotlib loads only when a plot is drawn)

  plt.rcParams.update({"font.size": 11, "axes.titlesize": 13, "axes.titleweight": "bold",
                       "axes.grid": True, "grid.alpha": 0.3, "legend.fontsize": 10})
  fig, axes = plt.subplots(3, 2, figsize=(15, 13))
  train = [r for r in records if _is_train(r)]
  step_label = "policy step (= policy_version)"

  # 1. reward and accuracy
  ax = axes[0, 0]
  s, r = series(train, "reward_mean")
  if s.size:
    ax.plot(s, r, color="tab:blue", alpha=0.35, lw=1, label="reward_mean (batch)")
    w = max(1, min(10, s.size // 5 or 1))
    ax.plot(s, moving_average(r, w), color="tab:blue", lw=2.2,
            label=f"reward_mean ({w}-step moving avg)")
  s_e, acc = series(train, "eval_accuracy")
  if s_e.size:
    ax.plot(s_e, acc, "o-", color="tab:green", lw=2, ms=6, label="eval_accuracy (greedy)")
  final = [r for r in records if "final/eval_accuracy" in r]
  if final:
    ax.plot([final[-1]["step"]], [final[-1]["final/eval_accuracy"]], "*", color="darkgreen",
            ms=16, label=f"final eval_accuracy {final[-1]['final/eval_accuracy']:.1%}")
  if results and "accuracy_before" in results:
    ax.axhline(float(results["accuracy_before"]), color="0.4", ls="--", lw=1.2,
               label=f"before SAO {float(results['accuracy_before']):.1%}")
  if not (s.size or s_e.size):
    _empty(ax, "reward")
  ax.set(title="Reward and held-out accuracy", xlabel=step_label,
         ylabel="reward / accuracy [fraction correct]", ylim=(-0.03, 1.03))
  ax.legend(loc="best")

  # 2. critic
  ax = axes[0, 1]
  s, ev = series(train, "explained_variance")
  if s.size:
    handles = ax.plot(s, ev, color="tab:purple", lw=2.2, zorder=3, label="explained_variance")
    handles.append(ax.axhline(0.6, color="tab:purple", ls=":", lw=1.2,
                              label="paper's critic (~0.6)"))
    ax.axhline(0.0, color="0.3", lw=0.8)
    s_v, vl = series(train, "value_loss")
    if s_v.size:
      ax2 = ax.twinx()
      handles += ax2.plot(s_v, vl, color="tab:orange", lw=1.0, alpha=0.55,
                          label="value_loss (right axis)")
      ax2.set_ylabel("value_loss [(V - R)^2, token mean]", color="tab:orange")
      ax2.tick_params(axis="y", colors="tab:orange")
      ax2.grid(False)
      ax.set_zorder(ax2.get_zorder() + 1)
      ax.patch.set_visible(False)  # EV drawn above the value-loss curve
    ax.legend(handles=handles, loc="upper right", framealpha=0.9)
  else:
    _empty(ax, "explained_variance")
  ax.set(title="Critic: explained variance (before its K updates)", xlabel=step_label,
         ylabel="explained variance [1 - Var(R-V)/Var(R)]")

  # 3. DIS masked fraction
  ax = axes[1, 0]
  any_mask = False
  for key, color, lab in (("masked_fraction", "black", "total"),
                          ("masked_fraction_low", "tab:blue", "low: ratio <= 1 - eps_low"),
                          ("masked_fraction_high", "tab:red", "high: ratio >= 1 + eps_high")):
    s, m = series(train, key)
    if s.size:
      any_mask = True
      total = key == "masked_fraction"
      ax.plot(s, 100 * m, color=color, lw=2.4 if total else 1.3, ls="--" if total else "-",
              zorder=3 if total else 2, label=f"{lab} (mean {100 * m.mean():.2f}%)")
  if any_mask:
    ax.legend(loc="best")
  else:
    _empty(ax, "masked_fraction")
  ax.set(title="DIS: action tokens masked out of the gradient", xlabel=step_label,
         ylabel="masked action tokens [% of action tokens]")
  ax.set_ylim(bottom=0)

  # 4. staleness histogram
  ax = axes[1, 1]
  hist = staleness_histogram(train)
  if hist.size and hist.sum() > 0:
    pct = 100 * hist / hist.sum()
    bars = ax.bar(np.arange(hist.size), pct, color="tab:cyan", edgecolor="black")
    for b, p in zip(bars, pct):
      ax.annotate(f"{p:.1f}%", (b.get_x() + b.get_width() / 2, b.get_height()),
                  ha="center", va="bottom", fontsize=10)
    ax.set_xticks(np.arange(hist.size))
    mean = float((np.arange(hist.size) * hist).sum() / hist.sum())
    ax.set_title(f"Token staleness over the run (mean {mean:.2f}, max {hist.size - 1})")
    ax.set_ylabel("action tokens [% of all trained tokens]")
  else:
    s, smax = series(train, "staleness_max")
    if s.size:
      vals, counts = np.unique(smax.astype(int), return_counts=True)
      ax.bar(vals, counts, color="tab:cyan", edgecolor="black")
      ax.set_title("Largest token staleness per step (no token histogram logged)")
      ax.set_ylabel("policy steps [count]")
    else:
      _empty(ax, "staleness")
      ax.set_title("Token staleness")
  ax.set_xlabel("staleness [policy versions behind the trainer]")

  # 5. throughput
  ax = axes[2, 0]
  s, tps = series(train, "tokens_per_s")
  if s.size:
    ax.plot(s, tps, color="tab:brown", lw=1.8, label=f"tokens_per_s (median {np.median(tps):.0f})")
    ax.legend(loc="best")
    ax.set_ylim(bottom=0)
  else:
    _empty(ax, "tokens_per_s")
  ax.set(title="Rollout throughput", xlabel=step_label,
         ylabel="sampled tokens per second [tokens/s]")

  # 6. time split
  ax = axes[2, 1]
  s_w, wait = series(train, "wait_s")
  s_t, tr = series(train, "train_s")
  if s_w.size and s_t.size and np.array_equal(s_w, s_t):
    ax.bar(s_w, wait, color="tab:orange", width=0.9,
           label=f"waiting for rollouts (wait_s, total {wait.sum():.0f} s)")
    ax.bar(s_t, tr, bottom=wait, color="tab:blue", width=0.9,
           label=f"training (train_s, total {tr.sum():.0f} s)")
    total = wait + tr
    rest = float(total[1:].max()) if total.size > 3 else 0.0
    if rest > 0 and total[0] > 2 * rest:  # the first step (jit compile) would flatten the rest
      top = 1.15 * rest
      ax.set_ylim(0, top)
      ax.annotate(f"step {s_w[0]}: {total[0]:.0f} s (clipped)", (s_w[0], top), xytext=(6, -14),
                  textcoords="offset points", fontsize=10, color="0.2")
    ax.legend(loc="upper right")
  else:
    _empty(ax, "wait_s / train_s")
  ax.set(title="Time per policy step: rollout wait vs training", xlabel=step_label,
         ylabel="wall time [s] (step 1 includes jit compilation)")
  if ax.get_ylim()[0] != 0:
    ax.set_ylim(bottom=0)
  from matplotlib.ticker import MaxNLocator  # pylint: disable=import-outside-toplevel  (matplotlib loads only when a plot is drawn)
  for a in axes.flat:
    a.xaxis.set_major_locator(MaxNLocator(integer=True))

  sup = "SAO run" + (f": {title}" if title else "")
  if results and "accuracy_after" in results:
    sup += (f"   |   held-out accuracy {float(results['accuracy_before']):.1%} -> "
            f"{float(results['accuracy_after']):.1%}")
  fig.suptitle(sup, fontsize=16, fontweight="bold")
  fig.tight_layout(rect=(0, 0, 1, 0.97))
  return fig


def write_dashboard(run_dir: str, out: Optional[str] = None, dpi: int = 100) -> str:
  """Writes the dashboard PNG of ``run_dir`` (default ``run_dir/plots/dashboard.png``) and
  returns its path. Raises FileNotFoundError if ``run_dir`` has no ``metrics.jsonl``."""
  records = load_records(run_dir)
  out = out or os.path.join(run_dir, "plots", "dashboard.png")
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  fig = dashboard(records, title=os.path.basename(os.path.normpath(run_dir)),
                  results=_results(run_dir))
  fig.savefig(out, dpi=dpi)
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel  (matplotlib loads only when a plot is drawn)
  plt.close(fig)
  return out


def main(argv: Optional[Sequence[str]] = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m sao_jax.plot",
                                   description=__doc__.split("\n")[0])
  parser.add_argument("run_dir", help="run folder holding metrics.jsonl (e.g. runs/arith_tool)")
  parser.add_argument("--out", default=None, help="PNG path (default RUN_DIR/plots/dashboard.png)")
  parser.add_argument("--dpi", type=int, default=100)
  args = parser.parse_args(argv)
  try:
    path = write_dashboard(args.run_dir, args.out, args.dpi)
  except (FileNotFoundError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(path)
  return 0


if __name__ == "__main__":
  sys.exit(main())
