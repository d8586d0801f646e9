"""Claim 1 (stability): SAO vs GRPO at matched staleness on the chained tool-use task.

Cells: the fixed rollout delays d in ``training_claims.DELAYS`` (1, 4, 8): every arm trains on
batches sampled with the weights of d policy versions ago (``rollout.lockstep_delay``), so every
arm's staleness is the same by construction; the table reports each arm's measured mean staleness
and flags a cell whose arms differ by more than 20% (not judged).

Arms (fixed before the runs): ``sao`` (the defaults of ``configs/chain_tool.py``: DIS, critic
K = 2 with frozen attention and value pre-training, skip-observation GAE); ``grpo`` (GRPO as the
paper runs it: 4 prompts x 8 rollouts per step -- the same 32 trajectories per step --, PPO clip
with clip-higher 0.2 / 0.28 against the policy at the start of the batch, M = 4 mini-batch
updates per batch so the ratio moves and the clip acts).

Collapse (fixed before the runs): 2 evals in a row below half the best eval so far (best >= 0.1);
the warm start's eval (step 0) counts as the first eval -- added after the runs of 2026-12-01,
when runs that fell from the warm start before their first periodic eval went uncounted (the
verdict of the stability runs is the same with and without it).
Verdict per cell: ``SAO ahead`` / ``GRPO ahead`` when the mean final accuracies differ by more
than 2 seed std (at least 0.02), else ``tie``. Claim: reproduced = no SAO run collapses, GRPO is
ahead in no cell, and SAO is ahead in a cell or a GRPO run collapses; not reproduced = an SAO run
collapses or GRPO is ahead in a cell; otherwise inconclusive.

``python experiments/stability.py`` (full: 2 arms x 3 delays x 3 seeds) / ``--quick``.
"""

from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  pylint: disable=wrong-import-position
import training_claims as tc  # noqa: E402  pylint: disable=wrong-import-position

EXPERIMENT = "stability"
TITLE = "1. Stability: SAO vs GRPO at matched staleness (fixed rollout delay)"
GRPO = {"train.mode": "grpo_async", "train.group_size": 8, "train.policy_minibatches": 4}
ARMS = (common.Arm("sao", {}), common.Arm("grpo", GRPO))
QUICK_ARMS = ("sao", "grpo")
QUICK_DELAYS = (2,)
COLLAPSE_EVALS = 2  # a collapse: this many evals in a row below half the best so far


def collapse_step(steps: np.ndarray, acc: np.ndarray, consecutive: int = COLLAPSE_EVALS):
  """The step of the ``consecutive``-th eval in a row whose accuracy is below half the best
  accuracy seen up to it (that best >= 0.1); None if that never happens. One dip is noise,
  two evals in a row are a collapse (issue 16 item 7; fixed before the runs)."""
  best, run = -np.inf, 0
  for s, a in zip(steps, acc):
    best = max(best, a)
    run = run + 1 if best >= 0.1 and a < best / 2 else 0
    if run >= consecutive:
      return int(s)
  return None


def run_table(rows, arms, seeds):
  """Per run: [arm, seed, acc before, best eval, final acc, collapse step, mean staleness,
  EV (mean of the last 5 steps), DIS/clip masked fraction (mean)]."""
  acc = common.eval_curves_from_start(rows)  # the warm start's eval is the point at step 0
  final = common.per_run_final(rows, "final_accuracy")
  init = common.per_run_final(rows, "initial_accuracy")
  stale = common.mean_over_steps(rows, "staleness_mean")
  masked = common.mean_over_steps(rows, "masked_fraction")
  ev = common.curves(rows, "explained_variance")
  table = []
  for arm in arms:
    for seed in seeds:
      x, y = acc.get(arm, {}).get(seed, (np.zeros(0), np.zeros(0)))
      c = collapse_step(x, y)
      e = ev.get(arm, {}).get(seed)
      table.append([arm, seed, init.get((arm, seed), float("nan")),
                    float(y.max()) if len(y) else float("nan"),
                    final.get((arm, seed), float("nan")), "-" if c is None else c,
                    stale.get((arm, seed), float("nan")),
                    float(np.mean(e[1][-5:])) if e is not None else "-",
                    masked.get((arm, seed), float("nan"))])
  return table


def cell_verdict(table, a="sao", b="grpo") -> tuple[str, float, float]:
  """("SAO ahead" | "GRPO ahead" | "tie", mean final of a, of b) by the module's rule."""
  fa = [r[4] for r in table if r[0] == a]
  fb = [r[4] for r in table if r[0] == b]
  if not fa or not fb:
    return "-", float(np.mean(fa)) if fa else float("nan"), float(np.mean(fb)) if fb else float(
        "nan")
  margin = 2 * max(np.std(fa), np.std(fb), 0.01)
  diff = np.mean(fa) - np.mean(fb)
  v = "SAO ahead" if diff > margin else "GRPO ahead" if diff < -margin else "tie"
  return v, float(np.mean(fa)), float(np.mean(fb))


def run(quick: bool, out_dir=None, report_only: bool = False) -> str:
  out_dir, md = common.out_paths(EXPERIMENT, quick, out_dir)
  arms = [a for a in ARMS if a.name in QUICK_ARMS] if quick else list(ARMS)
  seeds = tc.SEEDS_QUICK if quick else tc.SEEDS_FULL
  delays = QUICK_DELAYS if quick else tc.DELAYS
  sections, cells, csvs = [], [], []
  for d in delays:
    experiment = f"{EXPERIMENT}_d{d}"
    base = dict(tc.QUICK if quick else tc.FULL, **tc.fixed_delay(d))
    csv_path = common.run_training_arms(experiment, arms, seeds, quick=quick, out_dir=out_dir,
                                        metrics=tc.TRAIN_METRICS, base=base,
                                        report_only=report_only)
    csvs.append(csv_path)
    rows = common.read_rows(csv_path)
    common.plot(csv_path, os.path.join(out_dir, f"{experiment}.png"),
                [("eval_accuracy", None, "eval accuracy"), ("reward_mean", None, "train reward"),
                 ("masked_fraction", None, "masked (DIS band / PPO clip)"),
                 ("staleness_mean", None, "staleness")],
                title=f"SAO vs GRPO, fixed rollout delay d = {d}; mean and min-max over seeds")
    table = run_table(rows, [a.name for a in arms], seeds)
    per_arm, flagged = common.staleness_flag(common.mean_over_steps(rows, "staleness_mean"),
                                             [a.name for a in arms], tc.STALENESS_FLAG)
    verdict, m_sao, m_grpo = cell_verdict(table)
    if flagged:
      verdict = "flagged: arms' staleness differ by > 20%, not judged"
    n_coll = {a.name: sum(r[5] != "-" for r in table if r[0] == a.name) for a in arms}
    paired = common.paired_differences(common.per_run_final(rows, "final_accuracy"), "sao",
                                       "grpo", seeds)
    cells.append((d, verdict, m_sao, m_grpo, n_coll, per_arm, flagged))
    sections.append(f"""### Delay d = {d}

{common.markdown_table(["arm", "seed", "acc before", "best eval", "final acc (200)",
                        "collapse step", "staleness (mean)", "EV (last 5)", "masked (mean)"],
                       table)}

Mean staleness per arm: {", ".join(f"{k} {v:.2f}" for k, v in per_arm.items())}. Mean final
accuracy: sao {m_sao:.3f}, grpo {m_grpo:.3f}; collapses: {n_coll}; sao - grpo per seed
(paired, reported, not used by the rule): {" ".join(f"{x:+.3f}" for x in paired) or "-"}.
**Cell: {verdict}.**

![stability d={d}](results/{experiment}.png)
""")
  sao_coll = any(c[4].get("sao", 0) for c in cells if not c[6])
  grpo_ahead = any(c[1] == "GRPO ahead" for c in cells)
  sao_wins = any(c[1] == "SAO ahead" for c in cells) or any(
      c[4].get("grpo", 0) for c in cells if not c[6])
  verdict = ("not reproduced" if sao_coll or grpo_ahead else
             "reproduced" if sao_wins else "inconclusive")
  if quick:
    verdict = "inconclusive (quick run: pipeline check only)"
  cmd = "python experiments/stability.py" + (" --quick" if quick else "")
  summary = common.markdown_table(
      ["delay d", "sao mean final", "grpo mean final", "sao collapses", "grpo collapses",
       "cell"], [[c[0], c[2], c[3], c[4].get("sao", 0), c[4].get("grpo", 0), c[1]]
                 for c in cells])
  body = f"""Command: `{cmd}`

Setting (fixed in `experiments/training_claims.py` and the script): `configs/{tc.TASK}.py`{
':smoke' if quick else ''} with {tc.QUICK if quick else tc.FULL}, lockstep rollout with a fixed
delay d; arms {[a.name + ' ' + str(a.overrides) for a in arms]}; seeds {list(seeds)}. Both arms
train on 32 trajectories per step (SAO 32 prompts x 1, GRPO 4 x 8). Collapse = {COLLAPSE_EVALS}
evals in a row below half the best so far.

{summary}

{chr(10).join(sections)}
**Verdict: {verdict}** (rule in the module docstring, fixed before the runs).
"""
  common.write_section(md, EXPERIMENT, TITLE, body)
  return csvs[-1]


if __name__ == "__main__":
  common.main(__doc__, run)
