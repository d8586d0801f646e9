"""Supervised warm-up on demonstrations (gives the tiny policy a non-zero start)."""

from __future__ import annotations

from typing import Sequence

import jax.numpy as jnp
import numpy as np

from sao_jax.rollout.trajectory import bucket_length
from sao_jax.train import optim, steps


def pad_demos(demos: Sequence[tuple[Sequence[int], Sequence[int]]], pad_id: int,
              multiple: int = 32) -> dict[str, np.ndarray]:
  """[(ids, loss_mask)] -> {"tokens": int32 [N, T], "loss_mask": float32 [N, T]} right-padded."""
  t_len = bucket_length(max(len(ids) for ids, _ in demos), multiple)
  tokens = np.full((len(demos), t_len), pad_id, np.int32)
  mask = np.zeros((len(demos), t_len), np.float32)
  for i, (ids, m) in enumerate(demos):
    if len(ids) != len(m):
      raise ValueError(f"demo {i}: {len(ids)} tokens but {len(m)} loss_mask entries.")
    tokens[i, :len(ids)] = ids
    mask[i, :len(m)] = m
  return {"tokens": tokens, "loss_mask": mask}


def train_sft(graphdef, params, demos, *, pad_id: int, steps_: int, batch_size: int, lr: float,
              seed: int = 0, log_every: int = 0, log=print, on_step=None):
  """Runs ``steps_`` Adam steps of masked next-token cross-entropy on ``demos``.

  ``on_step(i)`` (optional) is called after step i (1-based), e.g. to advance a progress bar.
  Returns (params, last_loss)."""
  data = pad_demos(demos, pad_id)
  tx = optim.make_optimizer(params, lr=lr, warmup_steps=min(50, steps_ // 10))
  state = steps.TrainState.create(params, tx)
  step_fn = steps.make_sft_step(graphdef, tx)
  rng = np.random.default_rng(seed)
  n = data["tokens"].shape[0]
  loss = float("nan")
  for i in range(steps_):
    idx = rng.integers(0, n, batch_size)
    state, metrics = step_fn(state, {k: jnp.asarray(v[idx]) for k, v in data.items()})
    if on_step is not None:
      on_step(i + 1)
    if log_every and (i + 1) % log_every == 0:
      loss = float(metrics["sft_loss"])
      log(f"sft step {i + 1}/{steps_}  loss {loss:.4f}")
  return state.params, float(metrics["sft_loss"]) if steps_ else loss
