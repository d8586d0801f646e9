"""The decisive long-horizon stability cell (issue 30 item 2): SAO vs GRPO (M = 4 and M = 1) vs
GRPO+DIS at a fixed rollout delay d = 4 over 200 policy steps, 5 seeds, paired by seed.

Setting (fixed before the runs): `configs/chain_tool.py` (as ``stability.py``), the lockstep
rollout with a fixed delay of d = 4 policy versions (``rollout.lockstep_delay``: every arm's
staleness is the same by construction -- lag emulation, not a measurement of asynchrony; the
table reports each arm's measured staleness and flags the cell when the arms' means differ by
more than 20%), 200 policy steps of 32 trajectories, 400 held-out problems (``task.n_eval``; the
task draws 400 distinct eval problems, disjoint from its 4000 training problems), evaluated
greedily at step 0 (the warm start), every 25 steps and at step 200 -- every eval on all 400, so
the curve's points are comparable. Seeds 0-4; the arms of one seed share that seed's SFT warm
start (trained once, cached), so each seed gives one paired difference per baseline.

Arms (fixed): ``sao`` (the defaults: DIS, critic, skip-observation GAE, 1 update per batch);
``grpo_m4`` (``stability.py``'s GRPO: 4 prompts x 8 rollouts, PPO clip 0.2 / 0.28, M = 4
mini-batch updates per batch); ``grpo_m1`` (the same with M = 1: one update per batch, as SAO);
``grpo_dis`` (GRPO groups and group-normalised advantages with SAO's DIS objective,
``train.objective='dis'``, M = 1: the paper's GRPO+DIS; it differs from ``grpo_m1`` only in the
objective and from ``sao`` only in the advantages (groups, no critic)).

Rule (fixed before the runs). For each baseline b and seed s, the paired differences
d_s = sao - b of (a) the final accuracy (400 problems, step 200) and (b) the area under the eval
curve (trapezoid over steps 0..200, divided by 200: a mean accuracy). For each of (a), (b):
**SAO ahead** when all 5 d_s > 0 and the exact sign-flip p (``common.paired_test``) <= 0.0625
(the smallest two-sided p 5 seeds can give); **b ahead** in the mirror case; otherwise **no
difference shown**. Per baseline: **SAO ahead of b** when SAO is ahead on both (a) and (b);
**b ahead of SAO** when b is ahead on both; **b matches SAO** when neither shows a difference
and |mean d_s| <= 0.05 on both; otherwise **mixed/inconclusive**; fewer than 5 finished pairs:
**incomplete**. The paired t p is reported beside it, not used. Stated conclusion: if
``grpo_dis`` matches SAO (or is ahead), the stability at this horizon comes from DIS, not from
the critic; if SAO is ahead of ``grpo_dis``, SAO's lead is not from DIS alone. Collapses
(``stability.collapse_step``: 2 evals in a row below half the best so far, step 0 included) are
counted per arm and stated; they do not enter the rule.

``nice -n 10 python experiments/long_horizon.py`` runs the full study (20 runs of 200 steps;
estimated at about 4.5 hours on 2 shared CPU cores: per seed ~1200 s for sao and ~600-650 s
for each GRPO arm, from the per-step times of the d = 4 stability runs, the 400-problem evals
and a new SFT warm start per seed). It is resumable: each finished run is kept in
``experiments/results/long_horizon.csv`` and a rerun of the same command skips it (a run cut
short restarts from its step 0), so it can be spread over several sittings. ``--report_only``
rebuilds the table, plot and section from the CSV; ``--quick`` (`configs/chain_tool.py:smoke`,
the arms ``sao`` and ``grpo_dis`` at 2 steps, 1 seed, 8 eval problems) is the pipeline check of
the test suite and writes to its own out dir.
"""

from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  pylint: disable=wrong-import-position
import stability  # noqa: E402  pylint: disable=wrong-import-position
import training_claims as tc  # noqa: E402  pylint: disable=wrong-import-position

EXPERIMENT = "long_horizon"
TITLE = "1c. Long horizon: SAO vs GRPO (M = 4, M = 1) vs GRPO+DIS at d = 4 over 200 steps"
DELAY = 4
SEEDS_FULL, SEEDS_QUICK = (0, 1, 2, 3, 4), (0,)
STEPS, EVAL_EVERY, EVAL_PROBLEMS = 200, 25, 400
FULL = {"train.num_steps": STEPS, "eval.every_steps": EVAL_EVERY,
        "eval.periodic_problems": EVAL_PROBLEMS, "task.n_eval": EVAL_PROBLEMS}
QUICK = dict(tc.QUICK)  # configs/chain_tool.py:smoke, 2 steps, eval every step on 8 problems
ARMS = (common.Arm("sao", {}), stability.GRPO_M4, stability.GRPO_M1, stability.GRPO_DIS)
QUICK_ARMS = ("sao", "grpo_dis")  # the pipeline check: SAO and the one new objective/mode pair
MAX_P = 0.0625       # sign-flip p at or below which a 5/5 sign count is a difference
MATCH_MARGIN = 0.05  # |mean paired difference| within which a no-difference baseline "matches"


def metric_verdict(diffs, baseline: str) -> str:
  """"SAO ahead" | "<baseline> ahead" | "no difference shown" for the per-seed differences
  ``sao - baseline`` of one measure (the module's rule; needs all seeds)."""
  s = common.paired_test(diffs)
  if s["positive"] == s["n"] and s["p_sign_flip"] <= MAX_P + 1e-12:
    return "SAO ahead"
  if s["negative"] == s["n"] and s["p_sign_flip"] <= MAX_P + 1e-12:
    return f"{baseline} ahead"
  return "no difference shown"


def baseline_verdict(d_final, d_auc, baseline: str, n_seeds: int = len(SEEDS_FULL)) -> str:
  """The module's per-baseline rule on the paired differences of the final accuracy and the area
  under the eval curve (both ``sao - baseline``, one per seed)."""
  if min(len(d_final), len(d_auc)) < n_seeds:
    return f"incomplete ({min(len(d_final), len(d_auc))} of {n_seeds} seeds finished)"
  vf, va = metric_verdict(d_final, baseline), metric_verdict(d_auc, baseline)
  if vf == va == "SAO ahead":
    return f"SAO ahead of {baseline}"
  if vf == va == f"{baseline} ahead":
    return f"{baseline} ahead of SAO"
  if vf == va == "no difference shown" and max(abs(np.mean(d_final)),
                                               abs(np.mean(d_auc))) <= MATCH_MARGIN:
    return f"{baseline} matches SAO"
  return "mixed/inconclusive"


def conclusion(verdicts: dict) -> str:
  """The stated conclusion of the rule from ``{baseline: verdict}``."""
  v = verdicts.get("grpo_dis", "")
  if v.startswith("incomplete") or not v:
    return "not judged: the study is incomplete"
  if v in ("grpo_dis matches SAO", "grpo_dis ahead of SAO"):
    return ("GRPO+DIS matches or beats SAO at d = 4 over 200 steps: the stability comes from "
            "DIS, not from the critic or the single rollout")
  if v == "SAO ahead of grpo_dis":
    return "SAO is ahead of GRPO+DIS: its lead at this horizon is not from DIS alone"
  return "GRPO+DIS vs SAO is mixed: the source of SAO's stability is not attributed"


def run(quick: bool, out_dir=None, report_only: bool = False) -> str:
  out_dir, md = common.out_paths(EXPERIMENT, quick, out_dir)
  seeds = SEEDS_QUICK if quick else SEEDS_FULL
  arms = [a for a in ARMS if a.name in QUICK_ARMS] if quick else list(ARMS)
  base = dict(QUICK if quick else FULL, **tc.fixed_delay(DELAY))
  csv_path = common.run_training_arms(EXPERIMENT, arms, seeds, quick=quick, out_dir=out_dir,
                                      metrics=tc.TRAIN_METRICS, base=base,
                                      report_only=report_only)
  rows = common.read_rows(csv_path)
  common.plot(csv_path, os.path.join(out_dir, f"{EXPERIMENT}.png"),
              [("eval_accuracy", None, "eval accuracy"), ("reward_mean", None, "train reward"),
               ("masked_fraction", None, "masked (DIS band / PPO clip)"),
               ("staleness_mean", None, "staleness")],
              title=f"Long horizon, fixed rollout delay d = {DELAY}; mean and min-max over seeds")
  names = [a.name for a in arms]
  table = stability.run_table(rows, names, seeds)
  auc = common.curve_areas(rows)
  wall = common.per_run_final(rows, "rl_elapsed_s")
  for r in table:
    r.insert(5, auc.get((r[0], r[1]), float("nan")))
    r.append(wall.get((r[0], r[1]), float("nan")))
  final = common.per_run_final(rows, "final_accuracy")
  per_arm, flagged = common.staleness_flag(common.mean_over_steps(rows, "staleness_mean"),
                                           names, tc.STALENESS_FLAG)
  n_coll = {a: sum(r[6] != "-" for r in table if r[0] == a) for a in names}
  verdicts, lines, summary = {}, [], []
  for b in names[1:]:
    d_final = common.paired_differences(final, "sao", b, seeds)
    d_auc = common.paired_differences(auc, "sao", b, seeds)
    verdicts[b] = ("quick run: pipeline check only, not judged" if quick else
                   "flagged: the arms' staleness differ by > 20%, not judged" if flagged else
                   baseline_verdict(d_final, d_auc, b))
    lines.append(f"- sao - {b}: final {common.format_paired(d_final)}; area "
                 f"{common.format_paired(d_auc)}. **{verdicts[b]}.**")
  for a in names:
    f = [final[(a, s)] for s in seeds if (a, s) in final]
    ar = [auc[(a, s)] for s in seeds if (a, s) in auc]
    summary.append([a, len(f), float(np.mean(f)) if f else "-", float(np.mean(ar)) if ar else "-",
                    f"{n_coll[a]}/{len(f)}", per_arm.get(a, "-")])
  stated = "quick run: pipeline check only" if quick else conclusion(verdicts)
  cmd = ("nice -n 10 python experiments/long_horizon.py" + (" --quick" if quick else "") +
         " (resumable: finished runs are kept in the CSV)")
  body = f"""Command: `{cmd}`

Setting (fixed in the script before the runs): `configs/{tc.TASK}.py`{':smoke' if quick else ''}
with {base}; lockstep rollout with a fixed delay d = {DELAY} (lag emulation: equal staleness by
construction, so this cell tests stability under lag, not asynchrony); arms
{[a.name + ' ' + str(a.overrides) for a in arms]}; seeds {list(seeds)}; every arm trains on 32
trajectories per step (SAO 32 prompts x 1, GRPO 4 x 8). Area = trapezoid under the eval curve
(step 0 = the warm start) divided by the step span. Collapse = {stability.COLLAPSE_EVALS} evals
in a row below half the best so far.

{common.markdown_table(["arm", "runs", "mean final acc", "mean area", "collapses",
                        "staleness (mean)"], summary)}

{common.markdown_table(["arm", "seed", "acc before", "best eval", "final acc", "area",
                        "collapse step", "staleness (mean)", "EV (last 5)", "masked (mean)",
                        "RL wall s"], table)}

Paired differences per seed (sao - baseline; the exact sign-flip p and paired t p of
`common.paired_test`):

{chr(10).join(lines)}

![long horizon](results/{EXPERIMENT}.png)

**Verdict: {stated}.** Per baseline: {"; ".join(f"{b}: {v}" for b, v in verdicts.items())};
collapses per arm (not in the rule): {n_coll}. (Rule in the script's docstring, fixed before
the runs: per measure, 5/5 seeds of one sign with exact sign-flip p <= {MAX_P}; per baseline,
SAO (or the baseline) ahead on both the final accuracy and the area, or "matches" when neither
differs and |mean| <= {MATCH_MARGIN} on both.)
"""
  common.write_section(md, EXPERIMENT, TITLE, body)
  return csv_path


if __name__ == "__main__":
  common.main(__doc__, run)
