"""Shared settings of the three training-based claims (stability, ablations, online learning):
the full and quick settings, fixed here before any run."""

from __future__ import annotations

SEEDS_FULL = (0, 1, 2)
SEEDS_QUICK = (0,)  # quick = pipeline check only: one seed per arm

# Full setting: the README main job on the CPU task, shortened so that one run takes a few
# minutes on 2 shared cores (the default is 100 steps): 60 policy steps, eval every 10 steps on
# the first 100 held-out problems, final eval on 200.
FULL = {"train.num_steps": 60, "eval.every_steps": 10, "eval.periodic_problems": 100}
# Quick: configs/arith_tool.py:smoke (3 policy steps, batch 8, 20 SFT steps, 16 eval problems)
QUICK = {"train.num_steps": 2, "eval.every_steps": 1, "eval.periodic_problems": 8}

TRAIN_METRICS = ("eval_accuracy", "reward_mean", "explained_variance", "critic_grad_norm",
                 "masked_fraction", "value_loss", "staleness_mean", "policy_grad_norm")
