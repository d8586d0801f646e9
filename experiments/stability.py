"""Claim 1 (stability): SAO vs GRPO baselines under the same asynchrony, same task and compute.

Arms (fixed): ``sao`` (defaults: DIS + critic K=2, frozen attention, skip-observation GAE);
``grpo`` (asynchronous GRPO, group 8, PPO clip-higher 0.2/0.28, recomputed old policy);
``grpo_dis`` (the same with the DIS objective); ``vapo`` (critic, PPO clip-higher, no DIS). All
run with the asynchronous rollout worker (same staleness regime: whatever lag the queue makes).

Collapse (defined before running): after its best periodic eval accuracy, a run's eval accuracy
falls below half of that best (and the best is >= 0.1). Reported per run with the step.

``python experiments/stability.py`` (full) / ``--quick``; ``--setting stress`` for the harsher regime.
"""

from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  pylint: disable=wrong-import-position
import training_claims as tc  # noqa: E402  pylint: disable=wrong-import-position

EXPERIMENT = "stability"
TITLE = "1. Stability: SAO vs GRPO under asynchrony"
ARMS = (
    common.Arm("sao", {}),
    common.Arm("grpo", {"train.mode": "grpo_async", "train.group_size": 8}),
    common.Arm("grpo_dis", {"train.mode": "grpo_async", "train.group_size": 8,
                            "train.objective": "dis"}),
    common.Arm("vapo", {"train.mode": "vapo"}),
)
QUICK_ARMS = ("grpo",)  # quick: one run (~1 min), the mode most unlike the default
# A harsher regime, fixed before it was run (after the default setting saturated at ~95% for every
# arm): 3.3x the policy learning rate and a 4x deeper trajectory queue (staleness up to ~8 steps
# instead of ~3). ``--setting stress`` writes its own CSV, plot and RESULTS.md section.
STRESS = {"train.policy_lr": 1e-3, "rollout.queue_size": 256}
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


def run(quick: bool, out_dir=None, setting: str = "default",
        report_only: bool = False) -> str:
  stress = setting == "stress"
  experiment = EXPERIMENT + ("_stress" if stress else "")
  out_dir, md = common.out_paths(experiment, quick, out_dir)
  arms = [a for a in ARMS if a.name in QUICK_ARMS] if quick else list(ARMS)
  seeds = tc.SEEDS_QUICK if quick else tc.SEEDS_FULL
  base = dict(tc.QUICK if quick else tc.FULL, **(STRESS if stress else {}))
  csv_path = common.run_training_arms(experiment, arms, seeds, quick=quick, out_dir=out_dir,
                                      metrics=tc.TRAIN_METRICS, base=base,
                                      report_only=report_only)
  rows = common.read_rows(csv_path)
  png = common.plot(csv_path, os.path.join(out_dir, f"{experiment}.png"),
                    [("eval_accuracy", None, "eval accuracy"),
                     ("eval_accuracy", "rl_elapsed_s", "eval accuracy"),
                     ("reward_mean", None, "train reward")],
                    title="SAO vs GRPO/VAPO, asynchronous; mean and min-max over seeds")
  acc = common.curves(rows, "eval_accuracy")
  final = common.per_run_final(rows, "final_accuracy")
  init = common.per_run_final(rows, "initial_accuracy")
  table = []
  for arm in arms:
    for seed in seeds:
      x, y = acc.get(arm.name, {}).get(seed, (np.zeros(0), np.zeros(0)))
      c = collapse_step(x, y)
      table.append([arm.name, seed, init.get((arm.name, seed), float("nan")),
                    float(y.max()) if len(y) else float("nan"),
                    final.get((arm.name, seed), float("nan")), "-" if c is None else c])
  mean_final = {a.name: np.mean([final[(a.name, s)] for s in seeds]) for a in arms}
  n_coll = {a.name: sum(r[5] != "-" for r in table if r[0] == a.name) for a in arms}
  sao_best = ("sao" in mean_final and mean_final["sao"] >= max(mean_final.values()) - 0.02
              and n_coll["sao"] == 0)
  others_coll = any(n_coll[a] for a in n_coll if a != "sao")
  verdict = ("reproduced" if sao_best and others_coll else
             "inconclusive" if sao_best else "not reproduced")
  if quick:
    verdict = "inconclusive (quick run: pipeline check only)"
  cmd = ("python experiments/stability.py" + (" --setting stress" if stress else "") +
         (" --quick" if quick else ""))
  body = f"""Command: `{cmd}`

Setting: `configs/arith_tool.py`{':smoke' if quick else ''} with {base};
arms {[a.name + ' ' + str(a.overrides) for a in arms]}; seeds {list(seeds)}. Collapse = eval
accuracy below half its best after the best (best >= 0.1).

{common.markdown_table(["arm", "seed", "acc before", "best periodic acc", "final acc (200)",
                        "collapse step"], table)}

Mean final accuracy: {", ".join(f"{k} {v:.3f}" for k, v in mean_final.items())}.

The arms ran one after another on 2 CPU cores shared with other jobs (load average 5-9), so the
wall-clock panel (seconds since the first policy step) shows the order of magnitude only; the
policy-step panels are the comparison. GRPO uses 4 prompts x 8 rollouts per step, SAO/VAPO 32
prompts x 1: the same 32 trajectories per step.

![stability](results/{experiment}.png)

**Verdict: {verdict}** (rule fixed in the script: reproduced = SAO's mean final accuracy within
0.02 of the best arm, no SAO collapse, and at least one baseline run collapses; inconclusive =
SAO best but no baseline collapses at this scale; otherwise not reproduced).
"""
  title = ("1b. Stability under stress: policy lr 1e-3, trajectory queue 256" if stress
           else TITLE)
  common.write_section(md, experiment, title, body)
  return csv_path


if __name__ == "__main__":
  parser = common.common_argparser(__doc__)
  parser.add_argument("--setting", choices=("default", "stress"), default="default",
                      help="stress: policy lr 1e-3 and trajectory queue 256 (see STRESS)")
  args = parser.parse_args()
  run(args.quick, args.out_dir, args.setting, report_only=args.report_only)
