"""Skip-observation vs naive token GAE on the coding task (issue 29; paper Table 4's GAE row).

The coding task (`configs/swe_lite.py`: file views and test logs of several hundred observation
tokens per trajectory) is where the two estimators differ most: naive token GAE lets an action
token bootstrap from the observation token after it, so the terminal reward reaches the actions
of early turns through ~100s of observation tokens' worth of gamma * lam decay and value noise;
skip-observation GAE (SAO's) bootstraps an action from the next action token.

Setting (fixed before the runs): `configs/swe_lite.py` as it is (its SFT warm start, 60 policy
steps of 32 trajectories, the thread backend), arms ``sao`` (skip-observation GAE, the default)
and ``naive_gae`` (`train.advantage_estimator=naive_gae`), seeds 0, 1, 2. The two arms of one
seed share that seed's warm start (cached once), so each seed gives one paired difference.

Rule (fixed before the runs), on the paired differences d_s = final resolved rate of ``sao`` minus
that of ``naive_gae`` (the config's ``task.n_eval`` = 128 held-out instances): **skip-observation
GAE helps** when d_s > 0 for every seed and the mean of d_s is at least 0.03; **naive GAE helps**
when the same holds with the signs reversed; otherwise **no difference shown**. The exact sign-flip
p and the paired t p are reported beside it (with 3 seeds the smallest possible sign-flip p is 0.25,
so no claim of significance can come from this cell alone).

``python experiments/gae_coding.py`` (full; about 2 x 3 runs of the swe_lite job, resumable: a
finished run is kept in the CSV) / ``--quick`` (`configs/swe_lite.py:smoke`, both arms, 2 steps:
the pipeline check of the test suite) / ``--report_only``.
"""

from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  pylint: disable=wrong-import-position
import training_claims as tc  # noqa: E402  pylint: disable=wrong-import-position

EXPERIMENT = "gae_coding"
TITLE = "5. Skip-observation vs naive GAE on the coding task (swe_lite)"
TASK = "swe_lite"
SEEDS_FULL, SEEDS_QUICK = (0, 1, 2), (0,)
MIN_MEAN_DIFF = 0.03  # the rule's threshold on the mean paired difference (fixed before the runs)
ARMS = (
    common.Arm("sao", {}),
    common.Arm("naive_gae", {"train.advantage_estimator": "naive_gae"}),
)
METRICS = tc.TRAIN_METRICS + ("obs_tokens_mean",)
QUICK = {"train.num_steps": 2, "eval.every_steps": 0}


def verdict(diffs) -> str:
  """The fixed rule on the per-seed differences ``sao - naive_gae`` (see the module docstring)."""
  d = np.asarray(diffs, dtype=np.float64)
  if d.size < len(SEEDS_FULL):
    return f"incomplete ({d.size} of {len(SEEDS_FULL)} seeds finished)"
  if (d > 0).all() and d.mean() >= MIN_MEAN_DIFF:
    return "skip-observation GAE helps"
  if (d < 0).all() and d.mean() <= -MIN_MEAN_DIFF:
    return "naive GAE helps"
  return "no difference shown"


def run(quick: bool, out_dir=None, report_only: bool = False) -> str:
  out_dir, md = common.out_paths(EXPERIMENT, quick, out_dir)
  seeds = SEEDS_QUICK if quick else SEEDS_FULL
  csv_path = common.run_training_arms(
      EXPERIMENT, ARMS, seeds, quick=quick, out_dir=out_dir, metrics=METRICS,
      base=QUICK if quick else {}, config_fn=lambda q: common.base_config(q, TASK),
      report_only=report_only)
  rows = common.read_rows(csv_path)
  common.plot(csv_path, os.path.join(out_dir, f"{EXPERIMENT}.png"),
              [("eval_accuracy", None, "held-out resolved rate"),
               ("explained_variance", None, "explained variance"),
               ("reward_mean", None, "train reward"),
               ("obs_tokens_mean", None, "observation tokens / trajectory")],
              title="swe_lite: skip-observation (sao) vs naive GAE; mean and min-max over seeds")
  final = common.per_run_final(rows, "final_accuracy")
  initial = common.per_run_final(rows, "initial_accuracy")
  ev = common.mean_over_steps(rows, "explained_variance",
                              first_step=max(1, (QUICK if quick else {}).get("train.num_steps",
                                                                             60) - 9))
  obs = common.mean_over_steps(rows, "obs_tokens_mean")
  table = []
  for arm in ARMS:
    done = [s for s in seeds if (arm.name, s) in final]
    table.append([arm.name, " ".join(f"{initial[(arm.name, s)]:.3f}" for s in done),
                  " ".join(f"{final[(arm.name, s)]:.3f}" for s in done),
                  float(np.mean([final[(arm.name, s)] for s in done])) if done else "-",
                  float(np.mean([ev[(arm.name, s)] for s in done if (arm.name, s) in ev]))
                  if done else "-",
                  float(np.mean([obs[(arm.name, s)] for s in done if (arm.name, s) in obs]))
                  if done else "-"])
  diffs = common.paired_differences(final, "sao", "naive_gae", seeds)
  rule = "quick run: pipeline check only, not judged" if quick else verdict(diffs)
  cmd = "python experiments/gae_coding.py" + (" --quick" if quick else "")
  paired = common.format_paired(diffs)
  body = f"""Command: `{cmd}` (resumable: finished runs are kept in the CSV)

Setting (fixed): `configs/{TASK}.py`{':smoke' if quick else ''} with {QUICK if quick else {}};
arms {[a.name + ' ' + str(a.overrides) for a in ARMS]}; seeds {list(seeds)}; the arms of a seed
share its SFT warm start.

{common.markdown_table(["arm", "warm start per seed", "final per seed", "final mean",
                        "explained variance (last 10 steps)", "observation tokens / traj"],
                       table)}

Paired differences sao - naive_gae of the final resolved rate, per seed: {paired}.

![gae_coding](results/{EXPERIMENT}.png)

**Verdict: {rule}** (rule fixed in the script before the runs: skip-observation GAE helps when
sao - naive_gae > 0 for every seed with mean >= {MIN_MEAN_DIFF}; naive helps in the mirror case;
otherwise no difference shown).
"""
  common.write_section(md, EXPERIMENT, TITLE, body)
  return csv_path


if __name__ == "__main__":
  common.main(__doc__, run)
