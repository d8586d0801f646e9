"""Reference advantage formulas the algo tests compare against (test-only oracles): GRPO over
groups laid out as rows, and the running-mean baseline over an explicit reward window. The package
computes the same from group ids (``algo.group_normalized_advantages``) and from host-side windows
(``train.baselines`` + ``algo.baseline_advantages``)."""

import chex
import jax.numpy as jnp

from sao_jax.algo.advantages import float_dtype

Array = chex.Array
Numeric = chex.Numeric


def grpo_advantages(rewards: Array, normalize_std: bool = True, eps: Numeric = 1e-6) -> Array:
  """Group-normalised outcome advantages.

    A_{g,i} = (r_{g,i} - mean_i r_{g,i}) / (std_i r_{g,i} + eps)   (normalize_std)
    A_{g,i} =  r_{g,i} - mean_i r_{g,i}                            (otherwise)

  `std` is the population standard deviation (ddof = 0). A group whose rewards
  are all equal gets A = 0 (no NaN).

  Sources: GRPO, Shao et al. 2024 (DeepSeekMath) §4.1.2; without the std
  division, Dr. GRPO (Liu et al. 2025).

  Args:
    rewards: `[G_num, G]` float or int, one row per group of rollouts of one prompt.
    normalize_std: divide by the group std.
    eps: added to the std.

  Returns:
    `[G_num, G]`, at least float32.

  Raises:
    AssertionError (chex) if `rewards` is not rank 2.
  """
  chex.assert_rank(rewards, 2)
  dtype = float_dtype(rewards)
  r = jnp.asarray(rewards).astype(dtype)
  centred = r - jnp.mean(r, axis=-1, keepdims=True)
  if not normalize_std:
    return centred
  return centred / (jnp.std(r, axis=-1, keepdims=True) + jnp.asarray(eps, dtype))


def running_mean_baseline_advantage(reward: Array, window: Array) -> Array:
  """Advantage against a running-mean baseline of recent rewards.

    A = reward - mean(window),   with mean(empty window) = 0

  Used by the SAO paper as an ablation / online-learning baseline (mean of the
  last rewards for the same prompt, e.g. the last 128) in place of a critic.

  Source: SAO paper (Hou, Li, Tang, Dong, 2026), running-mean baseline.

  Args:
    reward: scalar or `[...]`, the new reward(s).
    window: `[..., W]` recent rewards (leading axes broadcast against
      `reward`); W may be 0, in which case the baseline is 0.

  Returns:
    advantage with the broadcast shape of `reward` and `window[..., 0]`,
    floating (at least float32).

  Raises:
    ValueError if `window` has rank 0.
  """
  window = jnp.asarray(window)
  reward = jnp.asarray(reward)
  if window.ndim < 1:
    raise ValueError(f'window must have rank >= 1, got shape {window.shape}.')
  dtype = float_dtype(reward, window)
  size = window.shape[-1]
  baseline = jnp.sum(window.astype(dtype), axis=-1) / max(size, 1)
  return reward.astype(dtype) - baseline
