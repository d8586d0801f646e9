"""Claim 3 (online learning, paper §4.5): the preferred output style switches every N policy
steps (``sao_jax/envs/style_switch.py``: plain -> "!" -> "~" after the final box, like the paper's
cute -> chuunibyou -> classical); SAO vs a running-mean baseline over the last 128 rewards
(``train.advantage_estimator=running_mean_global``). Training reward (correct AND in the current
style) is the online performance measure.

Adaptation lag (defined before running): for each phase k >= 1 starting at policy step s_k, the
number of steps from s_k until the reward (3-step moving average) first reaches 80% of that
phase's best (3-step moving average) reward; phases whose best is < 0.1 count as "never".
s_k is the step at which the env's episode counter (train episodes consumed + the before-eval
episodes) crosses k * N * batch_size; the asynchronous worker runs ahead of the trainer by at
most the queue, so the real switch can be up to a few steps earlier (same for both arms).

``python experiments/online_style.py`` (full) / ``--quick``.
"""

from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  pylint: disable=wrong-import-position
import training_claims as tc  # noqa: E402  pylint: disable=wrong-import-position

EXPERIMENT = "online_style"
TITLE = "3. Online learning: preferred style switches every N steps"
ARMS = (
    common.Arm("sao", {}),
    common.Arm("running_mean_128", {"train.advantage_estimator": "running_mean_global",
                                    "train.global_baseline_window": 128}),
)
QUICK_ARMS = ("running_mean_128",)  # quick: one run (~1 min)
SWITCH_FULL, SWITCH_QUICK = 20, 1
BASE_FULL = {"task.name": "style_switch", "sft.p_tool": 0.9, "train.num_steps": 60,
             "eval.every_steps": 0}
BASE_QUICK = {"task.name": "style_switch", "sft.p_tool": 0.9, "train.num_steps": 3,
              "eval.every_steps": 0}


def online_config(quick: bool):
  """``configs/arith_tool.py`` (``:smoke`` when quick) plus the ``task.switch_every`` field."""
  c = common.base_config(quick, "arith_tool")
  c.task.switch_every = SWITCH_QUICK if quick else SWITCH_FULL
  return c


def switch_steps(num_steps: int, batch: int, n_eval: int, switch_every: int) -> list[int]:
  """Policy steps s_k (k >= 1) at which the phase counter crosses k * switch_every * batch."""
  out, k = [], 1
  for s in range(1, num_steps + 1):
    while n_eval + s * batch >= k * switch_every * batch:
      if k * switch_every * batch > n_eval:
        out.append(s)
      k += 1
  return out


def adaptation_lags(steps: np.ndarray, reward: np.ndarray, starts: list[int], end: int):
  """Per phase start: steps to reach 80% of the phase's best 3-step moving-average reward (the
  average taken within the phase), or None (never / phase best < 0.1)."""
  lags = []
  for i, s in enumerate(starts):
    e = starts[i + 1] if i + 1 < len(starts) else end + 1
    sel = (steps >= s) & (steps < e)
    # trailing 3-step mean *within* the phase: the previous phase's rewards must not leak in
    seg = reward[sel]
    sm = np.array([seg[max(0, j - 2):j + 1].mean() for j in range(len(seg))])
    if not sel.any() or sm.max() < 0.1:
      lags.append(None)
      continue
    hit = np.nonzero(sm >= 0.8 * sm.max())[0][0]
    lags.append(int(steps[sel][hit] - s))
  return lags


def run(quick: bool, out_dir=None, report_only: bool = False) -> str:
  out_dir, md = common.out_paths(EXPERIMENT, quick, out_dir)
  seeds = tc.SEEDS_QUICK if quick else tc.SEEDS_FULL
  base = BASE_QUICK if quick else BASE_FULL
  arms = [a for a in ARMS if a.name in QUICK_ARMS] if quick else list(ARMS)
  csv_path = common.run_training_arms(EXPERIMENT, arms, seeds, quick=quick, out_dir=out_dir,
                                      metrics=("reward_mean",) + tc.TRAIN_METRICS[2:],
                                      base=base, config_fn=online_config,
                                      report_only=report_only)
  rows = common.read_rows(csv_path)
  common.plot(csv_path, os.path.join(out_dir, f"{EXPERIMENT}.png"),
              [("reward_mean", None, "reward (correct and in style)"),
               ("explained_variance", None, "explained variance")],
              title="style switches; mean and min-max over seeds")
  c = online_config(quick)
  common.apply_overrides(c, base)
  starts = switch_steps(c.train.num_steps, c.train.batch_size, c.task.n_eval, c.task.switch_every)
  rew = common.curves(rows, "reward_mean")
  table = []
  for arm in arms:
    for seed in seeds:
      x, y = rew[arm.name][seed]
      lags = adaptation_lags(x, y, starts, c.train.num_steps)
      table.append([arm.name, seed, float(y.mean()),
                    " ".join("never" if l is None else str(l) for l in lags)])
  def mean_lag(arm):  # nan when the arm has no run or never adapts
    ls = [l for r in table if r[0] == arm for l in r[3].split() if l != "never"]
    return float(np.mean([int(l) for l in ls])) if ls else float("nan")
  def mean_rew(arm):
    vals = [r[2] for r in table if r[0] == arm]
    return float(np.mean(vals)) if vals else float("nan")
  def std_rew(arm):
    vals = [r[2] for r in table if r[0] == arm]
    return float(np.std(vals)) if vals else float("nan")
  margin = 2 * max(std_rew("sao"), std_rew("running_mean_128"), 0.01)
  diff = mean_rew("sao") - mean_rew("running_mean_128")
  never = all("never" in r[3] for r in table)
  sao_better = diff > margin and not (mean_lag("sao") > mean_lag("running_mean_128"))
  verdict = ("reproduced" if sao_better else
             "inconclusive" if abs(diff) <= margin or never else "not reproduced")
  if never:
    verdict += (" (in every run some phase never reaches reward 0.1: after phase 0 rewards the "
                "plain style, neither arm produces the next phase's style with a correct answer "
                "again -- most likely the tiny policy's probability of the other styles collapsed "
                "in phase 0; the style distribution itself was not logged)")
  if quick:
    verdict = "inconclusive (quick run: pipeline check only)"
  zero_note = ""
  if len(starts) >= 3 and all(
      np.all(y[(x > starts[0]) & (x < starts[2])] == 0) for per in rew.values()
      for x, y in per.values()):
    zero_note = (f"How to read the lags: the switch step is estimated from the episode counter, "
                 f"so the step-{starts[0]} batch still holds pre-switch trajectories (lag 0 at "
                 f"the first switch); after it the reward of every run is exactly 0 until step "
                 f"{starts[2]}, where the plain style of phase 0 comes back.")
  cmd = "python experiments/online_style.py" + (" --quick" if quick else "")
  body = f"""Command: `{cmd}`

Setting: `configs/arith_tool.py`{':smoke' if quick else ''} with {base}, `task.switch_every` =
{c.task.switch_every} policy steps; arms {[a.name + ' ' + str(a.overrides) for a in ARMS]}; seeds
{list(seeds)}. Phase starts (policy steps): {starts}.

{common.markdown_table(["arm", "seed", "mean reward", "lag per switch (steps)"], table)}

Mean reward: sao {mean_rew('sao'):.3f}, running_mean_128 {mean_rew('running_mean_128'):.3f};
mean lag: sao {mean_lag('sao'):.1f}, running_mean_128 {mean_lag('running_mean_128'):.1f} steps.
{zero_note}
Seed std of the mean reward: sao {std_rew('sao'):.3f}, running_mean_128
{std_rew('running_mean_128'):.3f}. Explained variance below -1 (batches where every reward is 0
and the returns are float noise; `explained_variance` reports 0 for those since 2026-11-29) is
off the chart.

![online](results/{EXPERIMENT}.png)

**Verdict: {verdict}** (rule: reproduced = SAO's mean reward is higher by more than 2 seed std
(at least 0.02) and its mean lag is not longer; inconclusive = the difference is within that
margin or a phase is never learned; otherwise not reproduced. The first full run (2026-11-29)
was judged by a weaker rule -- higher mean reward, no longer lag -- which its 0.276 vs 0.275
passed; the margin was added after that run, the runs themselves are unchanged.)
"""
  common.write_section(md, EXPERIMENT, TITLE, body)
  return csv_path


if __name__ == "__main__":
  args = common.common_argparser(__doc__).parse_args()
  run(args.quick, args.out_dir, report_only=args.report_only)
