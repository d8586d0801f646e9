"""Claim 3 (online learning, paper §4.5): the preferred output style switches every N policy
steps (``sao_jax/envs/style_switch.py`` over ``configs/chain_tool.py``: plain -> "!" -> "~" after
the final box, like the paper's cute -> chuunibyou -> classical); SAO vs a running-mean baseline
over the last 128 rewards (``train.advantage_estimator=running_mean_global``), both at the same
fixed rollout delay (``training_claims.fixed_delay(4)``). Training reward (correct AND in the
current style) is the online performance measure; ``correct_mean`` and ``style{k}_fraction`` say
which half of it moved.

Exploration fix (chosen before the runs, 2026-12-01): on the old task no run ever earned a reward
after phase 0 -- the warm start writes each style a third of the time, phase 0's reward drives
the other styles' probability to ~0, and a style that is never sampled cannot be rewarded. Both
arms therefore keep the k3 KL to the warm-started policy, ``train.kl_coef = KL_COEF``. Used as a
loss on sampled tokens its gradient is that of the forward KL(pi_ref || pi) (mass-covering), so at
the style token the stationary point of  E[A] - beta KL(pi_ref || pi)  over a softmax gives each
unrewarded style  pi_o = (beta / 3) / (beta + c pi_p)  (c: the correct rate, pi_p: the preferred
style's probability): with beta = 0.1, c = 0.4 about 0.07, i.e. ~2 of a batch of 32 -- enough for
a switch to be noticed, small enough not to hold back the correctness the reward also needs.

Adaptation lag (defined before running): for each phase k >= 1 starting at policy step s_k, the
number of steps from s_k until the reward (3-step moving average) first reaches 80% of that
phase's best (3-step moving average) reward; phases whose best is < 0.1 count as "never". The
phase counter counts completed training episodes from the first policy step (the loop restarts
it after value pre-training, ``StyleSwitchEnv.reset_phase_clock``); under the lockstep rollout each
step's batch is generated during that step, so phase k is exactly steps k N + 1 .. (k + 1) N
(``phase_starts``). Those batches are sampled with the weights of 4 versions earlier (the delay),
so the lag includes the pipeline's delay, the same for both arms.

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
KL_COEF = 0.1  # the exploration fix (module doc), both arms
DELAY = 4      # the staleness control, both arms
ARMS = (
    common.Arm("sao", {}),
    common.Arm("running_mean_128", {"train.advantage_estimator": "running_mean_global",
                                    "train.global_baseline_window": 128}),
)
STYLE_NAMES = ("plain", "!", "~")
QUICK_ARMS = ("running_mean_128",)  # quick: one run (~1 min)
SWITCH_FULL, SWITCH_QUICK = 15, 1
_STYLE = {"task.name": "style_switch", "train.kl_coef": KL_COEF, "eval.every_steps": 0,
          **tc.fixed_delay(DELAY)}
BASE_FULL = {**_STYLE, "train.num_steps": 45}   # phases: steps 1-15, 16-30, 31-45
BASE_QUICK = {**_STYLE, "train.num_steps": 3}


def online_config(quick: bool):
  """``configs/chain_tool.py`` (``:smoke`` when quick) plus the style task's fields
  (``task.style_base``, ``task.switch_every``)."""
  c = common.base_config(quick, tc.TASK)
  c.task.style_base = tc.TASK
  c.task.switch_every = SWITCH_QUICK if quick else SWITCH_FULL
  return c


def phase_starts(num_steps: int, switch_every: int) -> list[int]:
  """First policy step s_k = k * switch_every + 1 (k >= 1, s_k <= num_steps) whose batch is graded
  by phase k. Exact under the lockstep rollout: each step's batch is generated during that step's
  ``take``, after value pre-training restarted the phase clock, so the env's episode counter
  reaches k * switch_every * batch_size at the end of step k * switch_every."""
  return list(range(switch_every + 1, num_steps + 1, switch_every))


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
                                      metrics=("reward_mean", "correct_mean", "style0_fraction",
                                               "style1_fraction", "style2_fraction")
                                      + tc.TRAIN_METRICS[2:],
                                      base=base, config_fn=online_config,
                                      report_only=report_only)
  rows = common.read_rows(csv_path)
  common.plot(csv_path, os.path.join(out_dir, f"{EXPERIMENT}.png"),
              [("reward_mean", None, "reward (correct and in style)"),
               ("correct_mean", None, "correct (any style)"),
               ("style0_fraction", None, "style 0 (plain) fraction"),
               ("style1_fraction", None, "style 1 (!) fraction"),
               ("style2_fraction", None, "style 2 (~) fraction"),
               ("explained_variance", None, "explained variance")],
              title="style switches; mean and min-max over seeds")
  c = online_config(quick)
  common.apply_overrides(c, base)
  starts = phase_starts(c.train.num_steps, c.task.switch_every)
  rew = common.curves(rows, "reward_mean")
  stale = common.curves(rows, "staleness_mean")
  table = []
  for arm in arms:
    for seed in seeds:
      x, y = rew[arm.name][seed]
      lags = adaptation_lags(x, y, starts, c.train.num_steps)
      table.append([arm.name, seed, float(y.mean()),
                    " ".join("never" if l is None else str(l) for l in lags),
                    float(stale[arm.name][seed][1].mean())])
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
    verdict += " (in every run some phase never reaches reward 0.1)"
  if quick:
    verdict = "inconclusive (quick run: pipeline check only)"
  style_rows = []
  bounds = [1] + starts + [c.train.num_steps + 1]
  for arm in arms:
    cells = []
    for k in range(len(bounds) - 1):
      fr = common.curves(rows, f"style{k % 3}_fraction")[arm.name]
      first, last = [], []
      for x, y in fr.values():
        seg = y[(x >= bounds[k]) & (x < bounds[k + 1])]
        first.append(seg[:5].mean() if len(seg) else np.nan)
        last.append(seg[-5:].mean() if len(seg) else np.nan)
      cells.append(f"{np.nanmean(first):.2f} -> {np.nanmean(last):.2f}")
    style_rows.append([arm.name] + cells)
  ev = common.curves(rows, "explained_variance").get("sao", {})
  ev_sao = float(np.mean([y.mean() for _, y in ev.values()])) if ev else float("nan")
  cmd = "python experiments/online_style.py" + (" --quick" if quick else "")
  style_header = ["arm"] + [f"phase {k} ({STYLE_NAMES[k % 3]})" for k in range(len(starts) + 1)]
  body = f"""Command: `{cmd}`

Setting: `configs/{tc.TASK}.py`{':smoke' if quick else ''} with {base}, `task.style_base` =
{tc.TASK}, `task.switch_every` =
{c.task.switch_every} policy steps; arms {[a.name + ' ' + str(a.overrides) for a in ARMS]}; seeds
{list(seeds)}. Phase starts (policy steps): {starts}.

{common.markdown_table(["arm", "seed", "mean reward", "lag per switch (steps)",
                        "mean staleness (versions)"], table)}

Mean reward: sao {mean_rew('sao'):.3f}, running_mean_128 {mean_rew('running_mean_128'):.3f};
mean lag: sao {mean_lag('sao'):.1f}, running_mean_128 {mean_lag('running_mean_128'):.1f} steps.
Seed std of the mean reward: sao {std_rew('sao'):.3f}, running_mean_128
{std_rew('running_mean_128'):.3f}. Per phase, mean over seeds of the fraction of the batch in the
phase's preferred style (first 5 / last 5 steps of the phase):

{common.markdown_table(style_header, style_rows)}

SAO's explained variance, mean over seeds and all steps: {ev_sao:.2f} (the reward turns on the
last token, the style, which a critic reading the prefix cannot foresee; the correct-answer part
is what it can learn).

![online](results/{EXPERIMENT}.png)

**Verdict: {verdict}** (rule: reproduced = SAO's mean reward is higher by more than 2 seed std
(at least 0.02) and its mean lag is not longer; inconclusive = the difference is within that
margin or a phase is never learned; otherwise not reproduced; fixed before the runs. The old
task's runs are in the section `arith_online_style`.)
"""
  common.write_section(md, EXPERIMENT, TITLE, body)
  return csv_path


if __name__ == "__main__":
  common.main(__doc__, run)
