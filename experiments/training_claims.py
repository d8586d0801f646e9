"""Shared settings of the training-based claims (stability, ablations, the stress cell, online
learning): the task, the full and quick settings, the staleness cells -- fixed here before any
run (issue 16).

The task is ``configs/chain_tool.py`` (3-4 chained calculator calls; the critic has something to
learn there). Every comparison runs its arms under the same staleness control: the lockstep
rollout with a fixed delay d (``rollout.lockstep_delay``), so every action token of every arm is
exactly d policy versions old (after the first d steps) and the measured staleness is equal by
construction -- the table still reports it, and flags a cell whose arms differ by > 20%.
"""

from __future__ import annotations

SEEDS_FULL = (0, 1, 2)
SEEDS_QUICK = (0,)  # quick = pipeline check only: one seed per arm
TASK = "chain_tool"

# Full setting: configs/chain_tool.py, 30 policy steps of 32 trajectories (the probe run learned
# most of its +39 pts by step 20), eval every 10 steps on the first 100 held-out problems, final
# eval on 200.
FULL = {"train.num_steps": 30, "eval.every_steps": 10, "eval.periodic_problems": 100}
# Quick: configs/chain_tool.py:smoke (tiny model, batch 8), 2 policy steps.
QUICK = {"train.num_steps": 2, "eval.every_steps": 1, "eval.periodic_problems": 8}

DELAYS = (1, 4, 8)        # the staleness cells: fixed rollout delay d (policy versions)
STALENESS_FLAG = 0.20     # a cell whose arms' mean staleness differ by more than this is flagged


def fixed_delay(d: int) -> dict:
  """Overrides of the lockstep rollout with a fixed delay of ``d`` policy versions."""
  return {"rollout.lockstep": True, "rollout.lockstep_delay": int(d)}


TRAIN_METRICS = ("eval_accuracy", "reward_mean", "explained_variance", "critic_grad_norm",
                 "critic_grad_norm_attn", "critic_grad_norm_rest",
                 "masked_fraction", "value_loss", "staleness_mean", "policy_grad_norm",
                 "value_mean", "value_min", "value_max", "advantage_mean", "ratio_min",
                 "ratio_max", "baseline_nonempty_fraction")
