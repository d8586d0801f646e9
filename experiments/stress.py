"""The stress cell (issue 16 item 3, issue 30 item 4): SAO, SAO with one remedy at a time, and
the GRPO baselines at a policy lr of 1e-3 and a rollout delay of 8, each with the same seeds.

Stress (fixed before the runs): policy lr 1e-3 (3.3x the default; the critic lr stays 1e-3,
1:1 -- the ratio at which the earlier stress runs collapsed) and a fixed rollout delay of 8
policy versions. In those runs the first mover was the critic: the mean value rose above the
best reward (1), every advantage turned negative and the policy was pushed off its good
answers.

Arms: ``no_pretrain`` (no value pre-training: the critic starts at a zero value head -- the
previous default); ``sao`` (the default now: value pre-training, the paper's setting); and one
remedy each on top of ``sao`` (ours, not the paper's): ``value_bounds`` (V clipped to the reward
range [0, 1] before GAE), ``critic_b1`` (critic Adam b1 = 0.5: less momentum), ``center_adv``
(advantages centred per batch).

Baselines (issue 30 item 4; added, with their rule, before their runs): ``grpo_m4``, ``grpo_m1`` and
``grpo_dis`` exactly as in ``long_horizon.py`` (``stability.GRPO_*``; GRPO, 4 prompts x 8 rollouts,
PPO clip with M = 4 or M = 1 updates per batch; GRPO+DIS: the groups' advantages with SAO's DIS
objective, M = 1), at the same stress.

Reported per arm: final accuracy, collapses (2 evals in a row below half the best so far), the
largest mean value and its excess over the batch's mean reward, the share of steps whose largest
value leaves the reward range, the mean advantage. Verdict (fixed): a remedy *holds* when none of
its seeds collapses and its mean final accuracy is not 2 seed std (at least 0.02) below the ``sao``
arm; it *helps* when it is 2 std above. Baselines (fixed before their runs): per baseline b and seed
s, the paired differences d_s = sao - b of the final accuracy and of the area under the eval curve
(steps 0-30, ``common.curve_area``; the rule is ``stability.direction_verdict``). Three seeds cannot
make a difference significant (the exact sign-flip p is at least 0.25), so the cell states a
direction only: **SAO ahead of b (3/3)** when every d_s > 0 on both measures, **b ahead of SAO
(3/3)** in the mirror case, else **no consistent direction**. An arm **survives** the stress when
none of its seeds collapses. Stated: the baselines that survive where SAO collapses, or that every
arm collapses (the stress then ranks no method).

``nice -n 10 python experiments/stress.py`` (full: 8 arms x 3 seeds; resumable from
``experiments/results/stress.csv``) / ``--quick``.
"""

from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  pylint: disable=wrong-import-position
import stability  # noqa: E402  pylint: disable=wrong-import-position
import training_claims as tc  # noqa: E402  pylint: disable=wrong-import-position

EXPERIMENT = "stress"
TITLE = ("1b. Past every method's limit: policy lr 1e-3 at delay 8 collapses SAO and GRPO "
         "(M = 4, M = 1, +DIS); SAO's remedies")
STRESS = dict(tc.fixed_delay(8), **{"train.policy_lr": 1e-3})
ARMS = (
    common.Arm("no_pretrain", {"train.critic_warmup_steps": 0}),
    common.Arm("sao", {}),
    common.Arm("value_bounds", {"train.value_bounds": (0.0, 1.0)}),
    common.Arm("critic_b1", {"train.critic_b1": 0.5}),
    common.Arm("center_adv", {"train.center_advantages": True}),
    stability.GRPO_M4, stability.GRPO_M1, stability.GRPO_DIS,
)
BASELINES = (stability.GRPO_M4.name, stability.GRPO_M1.name, stability.GRPO_DIS.name)
QUICK_ARMS = ("value_bounds",)


def run(quick: bool, out_dir=None, report_only: bool = False, seeds=None, only=None) -> str:
  """``seeds``: a subset of the fixed seeds (to split the runs over processes; merge the CSVs
  and rebuild with ``--report_only``); ``only``: run only these arms now (the CSV keeps the
  others' finished runs, and the report shows every arm)."""
  out_dir, md = common.out_paths(EXPERIMENT, quick, out_dir)
  arms = [a for a in ARMS if a.name in QUICK_ARMS] if quick else list(ARMS)
  unknown = set(only or ()) - {a.name for a in arms}
  if unknown:
    raise ValueError(f"--arms {sorted(unknown)}: not arms of this study; choose from "
                     f"{[a.name for a in arms]}")
  seeds = seeds or (tc.SEEDS_QUICK if quick else tc.SEEDS_FULL)
  base = dict(tc.QUICK if quick else tc.FULL, **STRESS)
  csv_path = common.run_training_arms(EXPERIMENT, [a for a in arms if not only or a.name in only],
                                      seeds, quick=quick, out_dir=out_dir,
                                      metrics=tc.TRAIN_METRICS, base=base,
                                      report_only=report_only)
  rows = common.read_rows(csv_path)
  common.plot(csv_path, os.path.join(out_dir, f"{EXPERIMENT}.png"),
              [("eval_accuracy", None, "eval accuracy"), ("value_mean", None, "mean value"),
               ("advantage_mean", None, "mean advantage"),
               ("explained_variance", None, "explained variance")],
              title="stress (policy lr 1e-3, delay 8); mean and min-max over seeds")
  finished = {r["arm"] for r in rows if r["metric"] == "final_accuracy"}
  pending = [a.name for a in arms if a.name not in finished]
  runs = stability.run_table(rows, [a.name for a in arms if a.name in finished], seeds)
  vmean, reward, vmax = (common.curves(rows, m) for m in ("value_mean", "reward_mean",
                                                          "value_max"))
  adv = common.mean_over_steps(rows, "advantage_mean")
  elapsed = common.per_run_final(rows, "rl_elapsed_s")
  table = []
  for arm in arms:
    r = [x for x in runs if x[0] == arm.name]
    f = [x[4] for x in r]
    peak, excess, out_of_range = [], [], []
    for s in seeds:
      if s not in vmean.get(arm.name, {}):
        continue
      v, rw, mx = vmean[arm.name][s][1], reward[arm.name][s][1], vmax[arm.name][s][1]
      n = min(len(v), len(rw))
      peak.append(float(v.max()))
      excess.append(float(np.max(v[:n] - rw[:n])))
      out_of_range.append(float(np.mean(mx > 1.0)))
    table.append([arm.name, " ".join(f"{v:.3f}" for v in f), float(np.mean(f)),
                  float(np.std(f)), sum(x[5] != "-" for x in r),
                  float(np.mean(peak)) if peak else "-", float(np.mean(excess)) if excess else "-",
                  float(np.mean(out_of_range)) if out_of_range else "-",
                  float(np.mean([adv[(arm.name, s)] for s in seeds if (arm.name, s) in adv])),
                  float(np.mean([elapsed.get((arm.name, s), np.nan) for s in seeds]))])
  table = [t for t in table if t[0] in finished]
  ref = next((t for t in table if t[0] == "sao"), None)
  verdicts = [f"{a}: not run" for a in pending if a not in BASELINES and a != "sao"]
  for t in table:
    if ref is None or t[0] == "sao" or t[0] in BASELINES:
      continue
    margin = 2 * max(t[3], ref[3], 0.01)
    holds = t[4] == 0 and t[2] >= ref[2] - margin
    helps = t[2] > ref[2] + margin
    verdicts.append(f"{t[0]}: {'helps' if helps else 'holds' if holds else 'does not hold'}")
  verdict = "; ".join(verdicts) if verdicts else "inconclusive (quick run: pipeline check only)"
  if ref is not None:
    verdict = f"sao (reference) collapses in {ref[4]} of {len(seeds)} seeds; " + verdict
  # the baselines: paired directions and survival
  auc = common.curve_areas(rows)
  final = common.per_run_final(rows, "final_accuracy")
  base_lines, survivors = [], []
  for b in [a.name for a in arms if a.name in BASELINES]:
    d_final = common.paired_differences(final, "sao", b, seeds)
    d_auc = common.paired_differences(auc, "sao", b, seeds)
    v = stability.direction_verdict(d_final, d_auc, b, len(seeds))
    collapses = next((t[4] for t in table if t[0] == b), 0)
    n_runs = sum(1 for s in seeds if (b, s) in final)
    if n_runs == len(seeds) and collapses == 0:
      survivors.append(b)
    base_lines.append(f"- sao - {b}: final {common.format_paired(d_final)}; area "
                      f"{common.format_paired(d_auc)}; {b} collapses in {collapses} of "
                      f"{n_runs}. **{v}.**")
  init = common.per_run_final(rows, "initial_accuracy")
  warm = {s: sorted({round(v, 4) for (a, s2), v in init.items() if s2 == s}) for s in seeds}
  warm_line = ("Warm starts (the accuracy before RL, per seed, over every arm: one value per seed "
               f"= the arms shared the warm start, so the differences are paired): {warm}")
  if base_lines and not quick:
    ran = [b for b in BASELINES if all((b, s) in final for s in seeds)]
    if len(ran) < len(BASELINES):
      stated = "not judged: the baselines' runs are incomplete"
    elif survivors:
      stated = (f"{', '.join(survivors)} survive(s) the stress on every seed where SAO "
                f"collapses in {ref[4] if ref else '?'} of {len(seeds)}")
    else:
      stated = ("every arm that ran collapses (SAO and every GRPO baseline): this stress ranks "
                "no method")
    verdict = f"{stated}. {verdict}"
  cmd = ("nice -n 10 python experiments/stress.py" + (" --quick" if quick else "") +
         " (resumable: finished runs are kept in the CSV)")
  body = f"""Command: `{cmd}`

Setting (fixed): `configs/{tc.TASK}.py`{':smoke' if quick else ''} with {base}; arms
{[a.name + ' ' + str(a.overrides) for a in arms]}; seeds {list(seeds)}.

{common.markdown_table(["arm", "final acc per seed", "mean", "std", "collapses",
                        "peak mean value", "max (mean value - mean reward)",
                        "steps with max value > 1", "mean advantage", "RL seconds"], table)}

Per run:

{common.markdown_table(["arm", "seed", "acc before", "best eval", "final acc (200)",
                        "collapse step", "staleness (mean)", "EV (last 5)", "masked (mean)"],
                       runs)}

Paired differences per seed for the baselines (sao - baseline; exact sign-flip and paired t
p of `common.paired_test`):

{chr(10).join(base_lines) if base_lines else "(no baseline arm in this run)"}

{warm_line}

Arms without a finished run in the CSV (rerun with `--arms`): {pending or "none"}.

![stress](results/{EXPERIMENT}.png)

**Verdict: {verdict}** (rule in the module docstring, fixed before the runs).
"""
  common.write_section(md, EXPERIMENT, TITLE, body)
  return csv_path


if __name__ == "__main__":
  parser = common.common_argparser(__doc__)
  parser.add_argument("--seeds", type=int, nargs="*", default=None,
                      help="a subset of the fixed seeds (default: all)")
  parser.add_argument("--arms", nargs="*", default=None,
                      help="run only these arms now (default: all); the report shows every arm")
  args = parser.parse_args()
  try:
    run(args.quick, args.out_dir, report_only=args.report_only, seeds=args.seeds, only=args.arms)
  except FileNotFoundError as e:  # --report_only before any run: say so, no traceback
    sys.exit(f"error: {e}")
