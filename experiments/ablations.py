"""Claim 2 (paper Tables 3-4, Fig. 4): ablations of SAO on the CPU task.

Arms (fixed): ``sao`` (full method); ``k1`` (one critic update per policy step); ``full_attn``
(critic attention trained); ``no_dis`` (PPO clip instead of DIS); ``running_mean`` (single rollout,
running-mean baseline of the last 8 rewards of the prompt, no critic in the advantage);
``step_gae_mean`` / ``step_gae_last`` (step-level GAE, average / last-token value per turn);
``naive_gae`` (token GAE through observation tokens). Curves: eval accuracy, explained variance
(Fig. 4a), critic gradient norm (Fig. 4b), DIS masked fraction (Fig. 4c).

``python experiments/ablations.py`` (full) / ``--quick`` (one arm, pipeline check).
"""

from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  pylint: disable=wrong-import-position
import training_claims as tc  # noqa: E402  pylint: disable=wrong-import-position

EXPERIMENT = "ablations"
TITLE = "2. Ablations (Tables 3-4; Fig. 4 curves)"
ARMS = (
    common.Arm("sao", {}),
    common.Arm("k1", {"train.critic_updates_per_step": 1}),
    common.Arm("full_attn", {"train.freeze_critic_attention": False}),
    common.Arm("no_dis", {"train.objective": "ppo_clip"}),
    common.Arm("running_mean", {"train.advantage_estimator": "running_mean_prompt",
                                "train.baseline_window": 8}),
    common.Arm("step_gae_mean", {"train.advantage_estimator": "step_gae_mean"}),
    common.Arm("step_gae_last", {"train.advantage_estimator": "step_gae_last"}),
    common.Arm("naive_gae", {"train.advantage_estimator": "naive_gae"}),
)
QUICK_ARMS = ("k1",)


def run(quick: bool, out_dir=None, report_only: bool = False) -> str:
  out_dir, md = common.out_paths(EXPERIMENT, quick, out_dir)
  arms = [a for a in ARMS if a.name in QUICK_ARMS] if quick else list(ARMS)
  seeds = tc.SEEDS_QUICK if quick else tc.SEEDS_FULL
  csv_path = common.run_training_arms(EXPERIMENT, arms, seeds, quick=quick, out_dir=out_dir,
                                      metrics=tc.TRAIN_METRICS, base=tc.QUICK if quick else tc.FULL,
                                      report_only=report_only)
  rows = common.read_rows(csv_path)
  common.plot(csv_path, os.path.join(out_dir, f"{EXPERIMENT}.png"),
              [("eval_accuracy", None, "eval accuracy"),
               ("explained_variance", None, "explained variance (4a)"),
               ("critic_grad_norm", None, "critic grad norm (4b)"),
               ("masked_fraction", None, "DIS masked fraction (4c)")],
              title="SAO ablations; mean and min-max over seeds")
  final = common.per_run_final(rows, "final_accuracy")
  ev = common.curves(rows, "explained_variance")
  gn = common.curves(rows, "critic_grad_norm")
  table = []
  for arm in arms:
    f = [final[(arm.name, s)] for s in seeds]
    evs = [float(np.mean(ev[arm.name][s][1][-5:])) for s in seeds if s in ev.get(arm.name, {})]
    gns = [float(np.mean(y[(x >= 1) & (x <= 20)])) for x, y in gn.get(arm.name, {}).values()]
    table.append([arm.name, " ".join(f"{v:.3f}" for v in f), float(np.mean(f)),
                  float(np.std(f)), float(np.mean(evs)) if evs else "-",
                  float(np.mean(gns)) if gns else "-"])
  sao = np.mean([final[("sao", s)] for s in seeds]) if ("sao", seeds[0]) in final else None
  if sao is None:
    verdict = "inconclusive (quick run without the sao arm)"
  else:
    worse = [r[0] for r in table if r[0] != "sao" and r[2] < sao - 2 * max(r[3], 0.01)]
    verdict = (f"reproduced for {worse}, not for the others" if worse else
               "not reproduced: no ablation is clearly (2 std) below SAO at this scale")
  cmd = "python experiments/ablations.py" + (" --quick" if quick else "")
  body = f"""Command: `{cmd}`

Setting: `configs/arith_tool.py`{':smoke' if quick else ''} with {tc.QUICK if quick else tc.FULL};
arms {[a.name + ' ' + str(a.overrides) for a in arms]}; seeds {list(seeds)}.

{common.markdown_table(["arm", "final acc per seed", "mean", "std", "EV (last 5 steps)",
                        "critic grad norm (steps 1-20)"], table)}

EV stays near 0 in every arm: the critic explains little of the return variance at this scale,
so the "strong critic" part of the method is barely exercised here.

![ablations](results/{EXPERIMENT}.png)

**Verdict: {verdict}** (rule fixed in the script: an ablation reproduces the paper when its mean
final accuracy is more than 2 std below SAO's).
"""
  common.write_section(md, EXPERIMENT, TITLE, body)
  return csv_path


if __name__ == "__main__":
  args = common.common_argparser(__doc__).parse_args()
  run(args.quick, args.out_dir, report_only=args.report_only)
