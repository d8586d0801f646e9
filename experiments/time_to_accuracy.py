"""Claim 4 on the real engine and trainer (issue 30 item 5): wall-clock time to a fixed held-out
accuracy, SAO (asynchronous) vs GRPO+DIS asynchronous (``grpo_async``) vs GRPO+DIS synchronous
(``grpo_sync``: the batch barrier), with and without a long-tailed tool latency.

Setting (fixed before the runs): `configs/chain_tool.py` (3-5 chained calculator calls) with its
real JetStream-style engine and learner, 40 policy steps of 32 trajectories, the natural
asynchrony of each mode (no lockstep: staleness is measured, not fixed), evals at step 0 (the warm
start) and every 5 steps on the same 400 held-out problems (``task.n_eval`` =
``eval.periodic_problems`` = 400; the warm starts of ``stability.py`` / ``long_horizon.py``,
cached per seed; evaluation runs without tool latency). Cells: ``lognormal`` -- every tool call of
a training rollout sleeps LogNormal(log 0.2 s, 1.0) (``task.tool_latency_median_s`` = 0.2,
``task.tool_latency_sigma`` = 1.0; the straggler setting of ``benchmarks/bench_pipeline.py``
section 4d), seeds 0-4; ``none`` -- no latency (short, uniform rollouts: nothing for a barrier to
wait for), seeds 0-2.

Arms (fixed): ``sao`` (the defaults: critic, DIS, one update per batch); ``grpo_async``
(``stability.py``'s GRPO+DIS: 4 prompts x 8 rollouts, group-normalised advantages, DIS objective,
M = 1, no critic) and ``grpo_sync`` (the same objective behind the synchronous barrier: batch n+1
is generated only with the weights of step n). ``grpo_async`` vs ``grpo_sync`` differ only in
scheduling; ``sao`` vs ``grpo_async`` only in the algorithm.

The clock: ``elapsed_s - warm_start_s - eval_total_s`` (``sao_jax/train/loop.py``): seconds
since the job started (compilation and SAO's critic warm-up of 10 steps on warm-start rollouts
included -- costs an arm really pays) minus the SFT warm start (trained by the first arm of a
seed, loaded from the cache by the others) and the seconds spent in held-out evals, so neither
the cache nor the eval schedule enters the measure. Rollout threads keep generating during an
eval (every arm: the synchronous barrier releases the next batch at the publish that precedes
the eval), a shared, small bias. Time to accuracy (TTA) of a run = that clock at the first eval
with accuracy >= ``TARGET`` (0.40 on 400 problems, about twice the warm starts' 0.175-0.24); a
run that never reaches it is censored at its 40-step clock and ranks as slower than any run that
does.

Rule (fixed before the runs). Per cell, baseline b and seed s: the paired ratio
r_s = TTA_b / TTA_sao (censored runs compare as above). On the ``lognormal`` cell (5 seeds):
**SAO faster than b** when all 5 r_s > 1 and the exact sign-flip p of log r_s
(``common.paired_test``) <= 0.0625; **b faster** in the mirror case; else **no difference
shown**. On the ``none`` cell (3 seeds: p >= 0.25 whatever happens) a direction only: 3/3 one way
or **no consistent direction**. The same is stated for ``grpo_async`` vs ``grpo_sync`` (the
scheduling alone). Beside it, not in the rule: trajectories per second of the RL phase per arm
(``rollout_trajectories`` over the training clock from step 1), mean measured staleness, final
accuracy.

``nice -n 10 python experiments/time_to_accuracy.py`` (24 runs; resumable: each finished run is
kept in ``experiments/results/time_to_accuracy_<cell>.csv``) / ``--quick`` (the smoke model,
sao and grpo_sync, 2 steps: the pipeline check of the test suite) / ``--report_only``.
Timings need a quiet machine: run nothing else meanwhile.
"""

from __future__ import annotations

import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  pylint: disable=wrong-import-position
import stability  # noqa: E402  pylint: disable=wrong-import-position
import training_claims as tc  # noqa: E402  pylint: disable=wrong-import-position

EXPERIMENT = "time_to_accuracy"
TITLE = "4b. Why async, on the real engine: wall-clock time to a fixed accuracy"
TARGET = 0.40
STEPS, EVAL_EVERY, EVAL_PROBLEMS = 40, 5, 400
FULL = {"train.num_steps": STEPS, "eval.every_steps": EVAL_EVERY,
        "eval.periodic_problems": EVAL_PROBLEMS, "task.n_eval": EVAL_PROBLEMS}
QUICK = dict(tc.QUICK)
CELLS = {"lognormal": ({"task.tool_latency_median_s": 0.2, "task.tool_latency_sigma": 1.0},
                       (0, 1, 2, 3, 4)),
         "none": ({}, (0, 1, 2))}
QUICK_CELLS = {"lognormal": ({"task.tool_latency_median_s": 0.05,
                              "task.tool_latency_sigma": 1.0}, (0,))}
GRPO_ASYNC = common.Arm("grpo_async", dict(stability.GRPO_DIS.overrides))
GRPO_SYNC = common.Arm("grpo_sync", dict(stability.GRPO_DIS.overrides,
                                         **{"train.mode": "grpo_sync"}))
ARMS = (common.Arm("sao", {}), GRPO_ASYNC, GRPO_SYNC)
QUICK_ARMS = ("sao", "grpo_sync")
METRICS = ("eval_accuracy", "reward_mean", "staleness_mean", "eval_total_s", "warm_start_s",
           "rollout_trajectories", "explained_variance")
MAX_P = 0.0625


def clocks(rows: list[dict]) -> dict:
  """``{(arm, seed): (steps, clock_s, accuracy, rollouts)}``: per logged eval step (step 0 = the
  warm start at clock 0), the training clock ``elapsed_s - warm_start_s - eval_total_s`` (s),
  the eval accuracy; ``rollouts`` = (clock at step 1, clock at the last step, trajectories generated
  between them) for the throughput column."""
  per = {}
  for r in rows:
    per.setdefault((r["arm"], int(r["seed"])), {}).setdefault(int(r["step"]), {})[
        r["metric"]] = float(r["value"])
  out = {}
  for key, steps in per.items():
    clock = {s: m["elapsed_s"] - m.get("eval_total_s", 0.0) - m.get("warm_start_s", 0.0)
             for s, m in steps.items() if "elapsed_s" in m}
    evals = sorted((s, m["eval_accuracy"]) for s, m in steps.items()
                   if "eval_accuracy" in m and s in clock)
    acc0 = steps.get(0, {}).get("initial_accuracy")
    xs = [0] + [s for s, _ in evals]
    ys = [acc0 if acc0 is not None else float("nan")] + [a for _, a in evals]
    ts = [0.0] + [clock[s] for s, _ in evals]
    last = max(clock)
    final = steps.get(last, {}).get("final_accuracy")
    if final is not None and (not xs or xs[-1] != last):  # the final eval (all 400) at the end
      xs, ys, ts = xs + [last], ys + [final], ts + [clock[last]]
    roll = (clock.get(1, float("nan")), clock[last],
            steps[last].get("rollout_trajectories", float("nan"))
            - steps.get(1, {}).get("rollout_trajectories", float("nan")))
    out[key] = (np.array(xs), np.array(ts), np.array(ys), roll)
  return out


def time_to_target(ts: np.ndarray, acc: np.ndarray, target: float = TARGET) -> tuple[float, bool]:
  """(seconds, reached): the clock of the first eval with accuracy >= ``target`` (the warm start
  at clock 0 excluded), else (the last clock, False) -- a censored run."""
  for t, a in zip(ts[1:], acc[1:]):
    if a >= target:
      return float(t), True
  return float(ts[-1]), False


def log_ratio(b: tuple, s: tuple) -> float:
  """log(TTA_b / TTA_sao) for (seconds, reached) pairs; a censored run is slower than any run
  that reached the target (+-inf when only one reached it; 0 when neither did)."""
  if b[1] and s[1]:
    return math.log(b[0] / s[0])
  if b[1] != s[1]:
    return math.inf if s[1] else -math.inf
  return 0.0


def ratio_verdict(logs, a: str, b: str, n_seeds: int) -> str:
  """The module's rule on the per-seed log ratios log(TTA_b / TTA_a)."""
  if len(logs) < n_seeds:
    return f"incomplete ({len(logs)} of {n_seeds} seeds finished)"
  pos, neg = sum(x > 0 for x in logs), sum(x < 0 for x in logs)
  if n_seeds < 5:
    return (f"{a} faster (3/3)" if pos == n_seeds else f"{b} faster (3/3)" if neg == n_seeds
            else "no consistent direction")
  finite = [float(np.clip(x, -10, 10)) for x in logs]  # +-inf: a sign, the largest magnitude
  p = common.paired_test(finite)["p_sign_flip"]
  if pos == n_seeds and p <= MAX_P + 1e-12:
    return f"{a} faster than {b}"
  if neg == n_seeds and p <= MAX_P + 1e-12:
    return f"{b} faster than {a}"
  return "no difference shown"


def run(quick: bool, out_dir=None, report_only: bool = False) -> str:
  out_dir, md = common.out_paths(EXPERIMENT, quick, out_dir)
  cells = QUICK_CELLS if quick else CELLS
  arms = [a for a in ARMS if a.name in QUICK_ARMS] if quick else list(ARMS)
  names = [a.name for a in arms]
  parts, csvs, stated = [], [], []
  for cell, (overrides, seeds) in cells.items():
    name = f"{EXPERIMENT}_{cell}"
    base = dict(QUICK if quick else FULL, **overrides)
    csv_path = common.run_training_arms(name, arms, seeds, quick=quick, out_dir=out_dir,
                                        metrics=METRICS, base=base, report_only=report_only)
    csvs.append(csv_path)
    rows = common.read_rows(csv_path)
    common.plot(csv_path, os.path.join(out_dir, f"{name}.png"),
                [("eval_accuracy", None, "eval accuracy"), ("reward_mean", None, "train reward"),
                 ("staleness_mean", None, "staleness")],
                title=f"time to accuracy, tool latency {cell}; mean and min-max over seeds")
    cl = clocks(rows)
    stale = common.mean_over_steps(rows, "staleness_mean")
    table, tta = [], {}
    for a in names:
      for s in seeds:
        if (a, s) not in cl:
          continue
        xs, ts, acc, (t1, tl, n) = cl[(a, s)]
        tta[(a, s)] = time_to_target(ts, acc)
        thr = n / (tl - t1) if tl > t1 else float("nan")
        t, reached = tta[(a, s)]
        at = int(xs[list(ts).index(t)]) if reached else "-"
        table.append([a, s, acc[0], f"{t:.1f}" + ("" if reached else " (not reached)"), at,
                      t1, tl - t1, thr, stale.get((a, s), float("nan")), acc[-1]])
    medians = "; ".join(
        f"{a} {np.median([r[5] for r in table if r[0] == a]):.1f} s before step 1 and "
        f"{np.median([r[6] for r in table if r[0] == a]):.1f} s for steps 1-{STEPS}, "
        f"{sum(r[4] == EVAL_EVERY for r in table if r[0] == a)} of "
        f"{sum(r[0] == a for r in table)} runs at the target by the first eval"
        for a in names if any(r[0] == a for r in table))
    lines, verdicts = [], {}
    for a, b in (("sao", "grpo_async"), ("sao", "grpo_sync"), ("grpo_async", "grpo_sync")):
      if a not in names or b not in names:
        continue
      pairs = [s for s in seeds if (a, s) in tta and (b, s) in tta]
      logs = [log_ratio(tta[(b, s)], tta[(a, s)]) for s in pairs]
      ratios = " ".join(f"{math.exp(x):.2f}" if math.isfinite(x) else ("inf" if x > 0 else "0")
                        for x in logs)
      verdicts[(a, b)] = ("quick run: pipeline check only" if quick else
                          ratio_verdict(logs, a, b, len(seeds)))
      lines.append(f"- TTA {b} / TTA {a} per seed {pairs}: {ratios}. "
                   f"**{verdicts[(a, b)]}.**")
      stated.append(f"{cell} latency, {a} vs {b}: {verdicts[(a, b)]}")
    parts.append(f"""### Tool latency: {cell} ({overrides or 'none'})

{common.markdown_table(["arm", "seed", "acc step 0", f"TTA s (acc >= {TARGET})",
                        "at step", "clock at step 1 s", "clock steps 1-end s",
                        "traj/s (RL phase)", "staleness (mean)", "final acc"], table)}

Where the clock goes (medians): {medians}. The clock at step 1 is the fixed cost (compiling,
the first batch, and for SAO the critic and its value pre-training, `train.critic_warmup_steps`
= 10 steps of 32 rollouts). Where most runs reach the target at their first eval, TTA is about
that fixed cost plus {EVAL_EVERY} steps, not the steady throughput: the steady part is the clock
of steps 1-{STEPS} and the traj/s column.

{chr(10).join(lines)}

![time to accuracy, {cell}](results/{name}.png)
""")
  cmd = "nice -n 10 python experiments/time_to_accuracy.py" + (" --quick" if quick else "")
  body = f"""Command: `{cmd}` (resumable: finished runs are kept in the CSVs; on a quiet machine)

Setting and rule (fixed in the script's docstring before the runs): `configs/{tc.TASK}.py` with
{QUICK if quick else FULL}, each mode's natural asynchrony (no lockstep); arms
{[a.name + ' ' + str(a.overrides) for a in arms]}; TTA = the training clock (`elapsed_s -
warm_start_s - eval_total_s`: job start to the eval, SFT and eval time excluded, SAO's critic
warm-up included) at the
first eval with accuracy >= {TARGET}; a run that never reaches it is censored and ranks slower.
Per pair and cell, the per-seed ratio TTA(second) / TTA(first); lognormal (5 seeds): all 5 > 1
with exact sign-flip p <= {MAX_P}, or the mirror; none (3 seeds): a direction only.

{chr(10).join(parts)}
**Verdict:** {"; ".join(stated)}. (The rule in the script's docstring; "faster" = less training
clock to {TARGET} on 400 held-out problems, evals excluded.)
"""
  common.write_section(md, EXPERIMENT, TITLE, body)
  print(f"wrote section {EXPERIMENT!r} of {md} from {', '.join(csvs)}", flush=True)
  return csvs[0]


if __name__ == "__main__":
  common.main(__doc__, run)
