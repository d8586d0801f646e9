"""Shared runner for the paper-claim experiments (issue 8): arms x seeds -> raw-curve CSV, a PNG of
mean +- spread across seeds, and a section of ``experiments/RESULTS.md``.

Every script fixes its arms, seeds and settings in code *before* running; every run made is
written to the CSV (one row per run x step x metric, appended as soon as the run finishes), so no
result can be selected after the fact.
"""

from __future__ import annotations

import csv
import dataclasses
import itertools
import json
import os
import re
import sys
import time
from typing import Any, Callable, Iterable, Optional, Sequence

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

CSV_FIELDS = ("experiment", "arm", "seed", "step", "metric", "value")
RESULTS_MD = os.path.join(ROOT, "experiments", "RESULTS.md")


@dataclasses.dataclass(frozen=True)
class Arm:
  """One configuration of an experiment: ``overrides`` maps dotted config fields
  (``"train.mode"``) to values applied on top of the base config."""
  name: str
  overrides: dict


def apply_overrides(config, overrides: dict):
  """Sets dotted fields of an ``ml_collections.ConfigDict`` in place; returns it.

  Raises KeyError naming the field when it does not exist in the config (a typo in an arm must
  not silently run the default)."""
  for key, value in overrides.items():
    node = config
    parts = key.split(".")
    for p in parts[:-1]:
      if p not in node:
        raise KeyError(f"config has no field {key!r} (missing {p!r}); fix the arm's overrides")
      node = node[p]
    if parts[-1] not in node:
      raise KeyError(f"config has no field {key!r}; fix the arm's overrides")
    node[parts[-1]] = value
  return config


def base_config(quick: bool, task: str = "chain_tool"):
  """``configs/<task>.py`` for the training experiments (``quick``: its ``:smoke`` variant, a few
  steps that check the pipeline, not the claim), with checkpoints, resume, TensorBoard and the
  progress bar off."""
  from sao_jax import configs  # pylint: disable=import-outside-toplevel
  c = configs.load(task, "smoke" if quick else "")
  c.checkpoint.every_steps = 0
  c.checkpoint.resume = False
  c.log.tensorboard = False
  c.log.progress = "off"
  return c


def read_metrics(run_dir: str) -> list[dict]:
  """Records of ``run_dir/metrics.jsonl`` (one dict per logged step)."""
  path = os.path.join(run_dir, "metrics.jsonl")
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


def append_rows(csv_path: str, rows: Iterable[Sequence]) -> None:
  """Appends long-format rows ``(experiment, arm, seed, step, metric, value)``; writes the header
  on a new file."""
  new = not os.path.exists(csv_path)
  os.makedirs(os.path.dirname(csv_path) or ".", exist_ok=True)
  with open(csv_path, "a", newline="", encoding="utf-8") as f:
    w = csv.writer(f)
    if new:
      w.writerow(CSV_FIELDS)
    w.writerows(rows)


def read_rows(csv_path: str) -> list[dict]:
  """The CSV as dicts with ``seed``/``step`` int and ``value`` float."""
  with open(csv_path, newline="", encoding="utf-8") as f:
    out = []
    for r in csv.DictReader(f):
      r["seed"], r["step"], r["value"] = int(r["seed"]), int(float(r["step"])), float(r["value"])
      out.append(r)
  return out


def _resume_point(csv_path: str, setting: dict) -> set:
  """The ``(arm, seed)`` runs already finished in ``csv_path`` (those with a ``final_accuracy``
  row), after checking that the CSV was written with the same ``setting`` (its
  ``.settings.json`` beside it; written here for a new CSV). ``setting["arms"]`` maps each arm to
  its overrides: an arm added to a study keeps the other arms' finished runs (the stored setting
  then lists it too), an arm left out is only not run now. Raises ValueError naming the changed
  keys (``base``, ``quick``, or ``arms.<name>`` for an arm whose overrides changed)."""
  settings_path = csv_path[:-len(".csv")] + ".settings.json"
  setting = json.loads(json.dumps(setting, sort_keys=True, default=str))
  if os.path.exists(csv_path) and os.path.exists(settings_path):
    with open(settings_path, encoding="utf-8") as f:
      stored = json.load(f)
    keys = (set(stored) | set(setting)) - {"arms"}
    changed = sorted(k for k in keys if stored.get(k) != setting.get(k))
    old_arms, arms = stored.get("arms", {}), setting.get("arms", {})
    changed += sorted(f"arms.{a}" for a in set(old_arms) & set(arms) if old_arms[a] != arms[a])
    if changed:
      raise ValueError(f"{csv_path} holds runs of another setting (changed: {changed}); delete it "
                       f"and {settings_path} to start this study over.")
    if set(arms) - set(old_arms):  # new arms: record them beside the finished ones
      with open(settings_path, "w", encoding="utf-8") as f:
        json.dump(dict(stored, arms={**old_arms, **arms}), f, indent=1, sort_keys=True)
    return {(r["arm"], r["seed"]) for r in read_rows(csv_path) if r["metric"] == "final_accuracy"}
  if os.path.exists(csv_path):  # a CSV from before settings were recorded: not trusted
    os.remove(csv_path)
  os.makedirs(os.path.dirname(csv_path) or ".", exist_ok=True)
  with open(settings_path, "w", encoding="utf-8") as f:
    json.dump(setting, f, indent=1, sort_keys=True)
  return set()


def paired_test(diffs: Sequence[float]) -> dict:
  """Paired statistics of per-seed differences ``diffs`` (arm A minus arm B, same seed):
  ``n``, ``mean``, ``positive`` / ``negative`` (sign count), ``p_sign_flip`` (exact two-sided
  sign-flip permutation test of the mean: the share of the 2**n sign patterns whose |mean| is
  at least the observed one) and ``p_t`` (two-sided paired t-test, NaN for n < 2 or zero
  spread). Raises ValueError on an empty list."""
  d = np.asarray(list(diffs), dtype=np.float64)
  if d.size == 0:
    raise ValueError("paired_test needs at least one paired difference")
  signs = np.array(list(itertools.product((-1.0, 1.0), repeat=d.size)))
  observed = abs(d.mean())
  p_flip = float(np.mean(np.abs((signs * np.abs(d)).mean(axis=1)) >= observed - 1e-12))
  p_t = float("nan")
  if d.size >= 2 and d.std(ddof=1) > 0:
    t = d.mean() / (d.std(ddof=1) / np.sqrt(d.size))
    from scipy import stats  # pylint: disable=import-outside-toplevel
    p_t = float(2 * stats.t.sf(abs(t), df=d.size - 1))
  return {"n": int(d.size), "mean": float(d.mean()), "positive": int((d > 0).sum()),
          "negative": int((d < 0).sum()), "p_sign_flip": p_flip, "p_t": p_t}


def run_training_arms(experiment: str, arms: Sequence[Arm], seeds: Sequence[int], *, quick: bool,
                      out_dir: str, metrics: Sequence[str], base: Optional[dict] = None,
                      config_fn: Callable[[bool], Any] = base_config,
                      report_only: bool = False) -> str:
  """Runs every arm with every seed through ``sao_jax.train.loop.run`` (in-process, one after the
  other) and appends each run's per-step ``metrics`` (plus ``elapsed_s``, ``rl_elapsed_s`` = seconds
  since the first policy step, and ``final_accuracy`` at
  the last step) to ``out_dir/<experiment>.csv`` as soon as it finishes.

  The CSV is the study's checkpoint: a run whose ``final_accuracy`` row is in it is not run again,
  so a killed or interrupted study resumes where it stopped (a run cut short wrote no row and
  runs again from its start). ``out_dir/<experiment>.settings.json`` records the setting (quick,
  ``base``, the arms' overrides); a CSV from another setting raises ValueError naming what
  changed (delete the CSV to start over). ``report_only`` runs nothing and returns the existing
  CSV (FileNotFoundError if there is none).

  Returns the CSV path. Raises whatever the run raises (a failed run is not hidden)."""
  from sao_jax.train import loop  # pylint: disable=import-outside-toplevel
  csv_path = os.path.join(out_dir, f"{experiment}.csv")
  if report_only:  # --report_only: rebuild the plot and RESULTS.md section from the existing CSV
    if not os.path.exists(csv_path):
      raise FileNotFoundError(f"--report_only needs {csv_path}; run the experiment first.")
    return csv_path
  done = _resume_point(csv_path, {"quick": bool(quick), "base": dict(base or {}),
                                  "arms": {a.name: a.overrides for a in arms}})
  for seed in seeds:  # seed-major: a run cut short leaves every arm with the same seeds
    for arm in arms:
      if (arm.name, int(seed)) in done:
        print(f"[{experiment}] {arm.name} seed {seed}: finished earlier (in {csv_path})",
              flush=True)
        continue
      c = config_fn(quick)
      apply_overrides(c, dict(base or {}))
      apply_overrides(c, arm.overrides)
      c.seed = int(seed)
      c.run_dir = os.path.join(out_dir, "runs", experiment, arm.name, f"seed{seed}")
      if not c.sft.cache_dir:  # the SFT warm start of a seed is trained once, shared by all arms
        c.sft.cache_dir = os.path.join(out_dir, "runs", "sft_cache")
      if os.path.exists(os.path.join(c.run_dir, "metrics.jsonl")):
        os.remove(os.path.join(c.run_dir, "metrics.jsonl"))
      t0 = time.time()
      summary = loop.run(c)
      rows = []
      t_first = None  # rl_elapsed_s: seconds since the first policy step (excludes the warm-up)
      for rec in read_metrics(c.run_dir):
        if "step" not in rec:
          continue
        if "elapsed_s" in rec and rec["elapsed_s"] is not None:
          t_first = rec["elapsed_s"] if t_first is None else t_first
          rows.append((experiment, arm.name, seed, rec["step"], "rl_elapsed_s",
                       float(rec["elapsed_s"] - t_first)))
        for m in tuple(metrics) + ("elapsed_s",):
          key = m
          if m.startswith("eval_") and f"final/{m}" in rec:  # the final eval (all problems)
            key = f"final/{m}"
          if key in rec and rec[key] is not None and np.isfinite(rec[key]):
            rows.append((experiment, arm.name, seed, rec["step"], m, float(rec[key])))
      rows.append((experiment, arm.name, seed, c.train.num_steps, "final_accuracy",
                   float(summary["accuracy_after"])))
      rows.append((experiment, arm.name, seed, 0, "initial_accuracy",
                   float(summary["accuracy_before"])))
      for when, step in (("before", 0), ("after", c.train.num_steps)):  # math tasks: the format
        if np.isfinite(summary.get(f"formatted_{when}", float("nan"))):
          rows.append((experiment, arm.name, seed, step, "eval_formatted",
                       float(summary[f"formatted_{when}"])))
      append_rows(csv_path, rows)
      print(f"[{experiment}] {arm.name} seed {seed}: accuracy {summary['accuracy_before']:.3f} -> "
            f"{summary['accuracy_after']:.3f} ({time.time() - t0:.0f}s)", flush=True)
  return csv_path


def curves(rows: list[dict], metric: str, x_metric: Optional[str] = None) -> dict:
  """``{arm: {seed: (x [n], y [n])}}`` of ``metric`` sorted by step; ``x_metric`` (e.g.
  ``"elapsed_s"``) replaces the step as x where both exist at the same step."""
  out: dict = {}
  by = {}
  for r in rows:
    by.setdefault((r["arm"], r["seed"], r["metric"]), {})[r["step"]] = r["value"]
  for (arm, seed, m), d in by.items():
    if m != metric:
      continue
    steps = sorted(d)
    if x_metric:
      xs = by.get((arm, seed, x_metric), {})
      steps = [s for s in steps if s in xs]
      x = np.array([xs[s] for s in steps], float)
    else:
      x = np.array(steps, float)
    out.setdefault(arm, {})[seed] = (x, np.array([d[s] for s in steps], float))
  return out


def mean_spread(per_seed: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
  """Mean, min and max across seeds on the x grid of the shortest seed (x taken as the mean
  across seeds at each index). Returns (x, mean, lo, hi), each float [n]."""
  n = min(len(v[1]) for v in per_seed.values())
  xs = np.stack([v[0][:n] for v in per_seed.values()])
  ys = np.stack([v[1][:n] for v in per_seed.values()])
  return xs.mean(0), ys.mean(0), ys.min(0), ys.max(0)


def plot(csv_path: str, png_path: str, panels: Sequence[tuple], title: str = "") -> str:
  """One PNG, one subplot per ``(metric, x_metric_or_None, ylabel[, "log"])`` panel: per arm the
  mean across seeds with the min-max band; an arm keeps its colour across panels. Returns
  ``png_path``."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  rows = read_rows(csv_path)
  fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.2), squeeze=False)
  arms = list(dict.fromkeys(r["arm"] for r in rows))
  colour = {a: f"C{i % 10}" for i, a in enumerate(arms)}
  for ax, (metric, x_metric, ylabel, *scale) in zip(axes[0], panels):
    for arm, per_seed in curves(rows, metric, x_metric).items():
      x, m, lo, hi = mean_spread(per_seed)
      ax.plot(x, m, label=f"{arm} (n={len(per_seed)})", lw=1.3, color=colour[arm])
      ax.fill_between(x, lo, hi, alpha=0.2, color=colour[arm])
    if scale and scale[0] == "log":
      ax.set_yscale("log")
    if metric == "explained_variance":  # EV < -1 (a degenerate batch) would flatten the curves
      ax.set_ylim(-1.0, 1.0)
    ax.set_xlabel(x_metric or "policy step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
  axes[0][0].legend(fontsize=7)
  if title:
    fig.suptitle(title, fontsize=9)
  fig.tight_layout()
  os.makedirs(os.path.dirname(png_path) or ".", exist_ok=True)
  fig.savefig(png_path, dpi=70)
  plt.close(fig)
  return png_path


def markdown_table(header: Sequence[str], rows: Sequence[Sequence]) -> str:
  """A GitHub markdown table; floats printed with 3 decimals."""
  def fmt(v):
    return f"{v:.3f}" if isinstance(v, float) else str(v)
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  lines += ["| " + " | ".join(fmt(v) for v in r) + " |" for r in rows]
  return "\n".join(lines)


def write_section(md_path: str, key: str, title: str, body: str) -> None:
  """Writes ``## title`` + ``body`` into ``md_path`` between markers for ``key``, replacing the
  previous section of the same key (re-running an experiment updates its section; other
  sections are untouched)."""
  begin, end = f"<!-- section:{key} -->", f"<!-- /section:{key} -->"
  block = f"{begin}\n## {title}\n\n{body.strip()}\n{end}\n"
  text = open(md_path, encoding="utf-8").read() if os.path.exists(md_path) else (
      "# Paper claims at small scale\n\nOne section per claim, written by the scripts "
      "in `experiments/`. Each lists the exact command, the setting, every run's numbers and a "
      "verdict.\n\n")
  pat = re.compile(re.escape(begin) + r".*?" + re.escape(end) + r"\n?", re.S)
  text = pat.sub(lambda _: block, text) if pat.search(text) else text.rstrip("\n") + "\n\n" + block
  os.makedirs(os.path.dirname(md_path) or ".", exist_ok=True)
  with open(md_path, "w", encoding="utf-8") as f:
    f.write(text)


def out_paths(experiment: str, quick: bool, out_dir: Optional[str]) -> tuple[str, str]:
  """(out_dir, RESULTS.md path): full runs without ``out_dir`` write under ``experiments/``
  (CSV, PNG committed) and ``experiments/RESULTS.md``; quick runs default to
  ``runs/experiments_quick``; a given ``out_dir`` (or a quick run) gets its own RESULTS.md there,
  so neither a test nor a side run overwrites the real results."""
  given = out_dir is not None
  if out_dir is None:
    out_dir = os.path.join(ROOT, "runs", "experiments_quick") if quick else os.path.join(
        ROOT, "experiments", "results")
  md = os.path.join(out_dir, "RESULTS.md") if quick or given else RESULTS_MD
  os.makedirs(out_dir, exist_ok=True)
  return out_dir, md


def common_argparser(doc: str):
  """``--quick`` and ``--out_dir`` for every experiment script."""
  import argparse  # pylint: disable=import-outside-toplevel
  p = argparse.ArgumentParser(description=doc)
  p.add_argument("--quick", action="store_true", help="tiny setting for the test suite")
  p.add_argument("--out_dir", default=None,
                 help="where CSV/PNG/runs and (when given) its own RESULTS.md go (see out_paths)")
  p.add_argument("--report_only", action="store_true",
                 help="no runs: rebuild the plot and the RESULTS.md section from the CSV")
  return p


def main(doc: str, run) -> None:
  """An experiment script's command line (``common_argparser``): calls ``run(quick, out_dir,
  report_only=)``; a missing CSV (``--report_only`` before any run) or a CSV of another setting
  exits with the message, no traceback."""
  args = common_argparser(doc).parse_args()
  try:
    run(args.quick, args.out_dir, report_only=args.report_only)
  except (FileNotFoundError, ValueError) as e:
    sys.exit(f"error: {e}")


def per_run_final(rows: list[dict], metric: str) -> dict:
  """``{(arm, seed): value at the largest step}`` of ``metric``."""
  out: dict = {}
  for r in rows:
    if r["metric"] == metric:
      k = (r["arm"], r["seed"])
      if k not in out or r["step"] >= out[k][0]:
        out[k] = (r["step"], r["value"])
  return {k: v[1] for k, v in out.items()}


def mean_over_steps(rows: list[dict], metric: str, first_step: int = 1) -> dict:
  """``{(arm, seed): mean of metric over steps >= first_step}`` (NaN-free rows only)."""
  acc: dict = {}
  for r in rows:
    if r["metric"] == metric and r["step"] >= first_step:
      acc.setdefault((r["arm"], r["seed"]), []).append(r["value"])
  return {k: float(np.mean(v)) for k, v in acc.items()}


def paired_differences(final: dict, a: str, b: str, seeds: Sequence[int]) -> list[float]:
  """Per seed, final accuracy of arm ``a`` minus arm ``b`` (both arms start from that seed's
  warm start, so the difference removes the warm start's seed-to-seed spread)."""
  return [final[(a, s)] - final[(b, s)] for s in seeds if (a, s) in final and (b, s) in final]


def format_paired(diffs: Sequence[float]) -> str:
  """The per-seed differences and ``paired_test`` of them in one line: "+0.100 +0.200 (mean
  +0.150; 2 positive / 0 negative; exact sign-flip p = 0.500; paired t p = 0.205)"; "-" when
  there is none."""
  if not len(diffs):
    return "-"
  s = paired_test(diffs)
  return (f"{' '.join(f'{d:+.3f}' for d in diffs)} (mean {s['mean']:+.3f}; {s['positive']} "
          f"positive / {s['negative']} negative; exact sign-flip p = {s['p_sign_flip']:.3f}; "
          f"paired t p = {s['p_t']:.3f})")


def eval_curves_from_start(rows: list[dict]) -> dict:
  """``{arm: {seed: (steps [n], accuracy [n])}}`` of ``eval_accuracy`` with the warm start's eval
  (``initial_accuracy``) as the point at step 0, where the run has one."""
  init = per_run_final(rows, "initial_accuracy")
  out = curves(rows, "eval_accuracy")
  for (arm, seed), a0 in init.items():
    x, y = out.setdefault(arm, {}).get(seed, (np.zeros(0), np.zeros(0)))
    out[arm][seed] = (np.concatenate([[0.0], x]), np.concatenate([[a0], y]))
  return out


def curve_area(steps: np.ndarray, acc: np.ndarray) -> float:
  """Area under the eval curve: the trapezoid rule over ``steps``, divided by the step span (so
  it is a mean accuracy, in [0, 1] for accuracies in [0, 1]). Raises ValueError for fewer than 2
  points or a zero span."""
  steps, acc = np.asarray(steps, np.float64), np.asarray(acc, np.float64)
  if steps.size < 2 or steps[-1] == steps[0]:
    raise ValueError(f"curve_area needs >= 2 eval points over a non-zero step span, got steps "
                     f"{steps.tolist()}; set eval.every_steps so that the run has them")
  return float(np.sum((acc[1:] + acc[:-1]) / 2 * np.diff(steps)) / (steps[-1] - steps[0]))


def curve_areas(rows: list[dict]) -> dict:
  """``{(arm, seed): curve_area}`` of every run's eval curve from its warm start
  (``eval_curves_from_start``); runs with fewer than 2 eval points are left out."""
  return {(arm, s): curve_area(*xy) for arm, per in eval_curves_from_start(rows).items()
          for s, xy in per.items() if len(xy[0]) >= 2}


def staleness_flag(mean_staleness: dict, arms: Sequence[str], tolerance: float) -> tuple:
  """(per-arm mean staleness over seeds, flagged): flagged when the arms' means differ by more
  than ``tolerance`` (relative to the largest), i.e. the cell cannot be judged (issue 16)."""
  per_arm = {a: float(np.mean([v for (arm, _), v in mean_staleness.items() if arm == a]))
             for a in arms if any(arm == a for arm, _ in mean_staleness)}
  vals = list(per_arm.values())
  flagged = bool(vals) and max(vals) > 0 and (max(vals) - min(vals)) / max(vals) > tolerance
  return per_arm, flagged


def not_run_section(md_path: str, key: str, title: str, command: str, setting: str,
                    reason: str = "") -> None:
  """A section that says the full setting has not been run yet (no numbers invented)."""
  write_section(md_path, key, title, f"""Command: `{command}`

Setting (fixed in the script): {setting}

**Verdict: not run yet.** The full setting did not fit in the time of the session that built the
script (2 shared CPU cores){reason}; run the command above and this section is replaced with the
table, the plot and the verdict. The `--quick` variant runs in the test suite
(`tests/integration/test_experiments.py`) and only checks the pipeline.
""")
