"""Critic loss and diagnostics for SAO.

Pure JAX kernels, no state and no I/O. Layout is token-major and padded,
`[batch, time]`; `action_mask` is non-zero on policy-generated tokens, and the
critic is trained and evaluated on those tokens only.
"""

from typing import Dict, Optional, Tuple

import chex
import jax
import jax.numpy as jnp

from sao_jax.algo.advantages import float_dtype

Array = chex.Array
Numeric = chex.Numeric


def value_loss(
    values: Array,
    returns: Array,
    action_mask: Array,
    old_values: Optional[Array] = None,
    clip_eps: Optional[Numeric] = None,
) -> Tuple[Array, Dict[str, Array]]:
  """Critic regression loss, token mean over action tokens.

    l_t  = (V_t - sg(R_t))^2                                    (no 0.5 factor)
    loss = sum_t l_t * action_mask_t / max(sum_t action_mask_t, 1)

  Optional PPO-style value clipping (when `clip_eps` is given):

    V^clip_t = V^old_t + clip(V_t - V^old_t, -clip_eps, clip_eps)
    l_t      = max((V_t - R_t)^2, (V^clip_t - R_t)^2)

  Source: SAO paper, critic loss (V - R)^2 (token mean, no clipping by
  default); value clipping as in PPO implementations (Schulman et al. 2017).

  Args:
    values: `[B, T]` float, critic predictions V_t (differentiated).
    returns: `[B, T]` float, targets R_t (under `stop_gradient`).
    action_mask: `[B, T]`, any dtype; non-zero on policy-generated tokens.
    old_values: optional `[B, T]` float, critic values at rollout / target
      time; required iff `clip_eps` is given.
    clip_eps: optional clipping half-width (python float or scalar).

  Returns:
    `(loss, metrics)` in `result_type(inputs, float32)`. metrics (scalars, no
    gradient): `value_loss`, `value_mean` and `return_mean` (means over action
    tokens), `value_clipped_fraction` (fraction of action tokens where the
    clipped term is the larger one; 0 without clipping). A batch without action
    tokens gives loss 0 and all-zero metrics.

  Raises:
    AssertionError (from chex) on arrays that are not rank 2, differ in shape,
    or (values / returns / old_values) are not floating.
    ValueError if `clip_eps` is given without `old_values`.
  """
  chex.assert_rank([values, returns, action_mask], 2)
  chex.assert_equal_shape([values, returns, action_mask])
  chex.assert_type([values, returns], float)
  if clip_eps is not None and old_values is None:
    raise ValueError('value clipping (clip_eps) needs old_values.')
  arrays = [values, returns]
  if old_values is not None:
    chex.assert_rank(old_values, 2)
    chex.assert_equal_shape([values, old_values])
    chex.assert_type(old_values, float)
    arrays.append(old_values)
  dtype = float_dtype(*arrays)

  is_action = jnp.asarray(action_mask).astype(bool)
  denom = jnp.maximum(jnp.sum(is_action, dtype=dtype), 1.0)
  values = values.astype(dtype)
  returns = jax.lax.stop_gradient(returns.astype(dtype))

  def _action_mean(x):
    return jnp.sum(jnp.where(is_action, x, 0.0)) / denom

  per_token = jnp.square(values - returns)
  clipped_frac = jnp.zeros((), dtype)
  if clip_eps is not None:
    old = jax.lax.stop_gradient(old_values.astype(dtype))
    eps = jnp.asarray(clip_eps, dtype)
    v_clip = old + jnp.clip(values - old, -eps, eps)
    per_token_clip = jnp.square(v_clip - returns)
    clipped_frac = _action_mean((per_token_clip > per_token).astype(dtype))
    per_token = jnp.maximum(per_token, per_token_clip)

  loss = _action_mean(per_token)
  metrics = {
      'value_loss': jax.lax.stop_gradient(loss),
      'value_mean': _action_mean(jax.lax.stop_gradient(values)),
      'return_mean': _action_mean(returns),
      'value_clipped_fraction': jax.lax.stop_gradient(clipped_frac),
  }
  metrics = {k: v.astype(dtype) for k, v in metrics.items()}
  return loss.astype(dtype), metrics


EV_MIN_RETURN_VAR = 1e-10  # Var(R) at or below this (reward units^2): EV undefined, reported as 0


def explained_variance(
    values: Array,
    returns: Array,
    action_mask: Array,
) -> Array:
  """Explained variance of the critic over action tokens.

    EV = 1 - Var(R - V) / Var(R)

  Variances are population variances (divide by the token count) over action
  tokens only. EV = 1 is a perfect critic, 0 is no better than a constant, and
  negative is worse than a constant. When Var(R) <= EV_MIN_RETURN_VAR (1e-10
  reward^2: constant returns up to float noise, e.g. a batch where every reward
  is 0 and the returns are tiny critic values; also batches with no action
  tokens) EV is undefined; this returns 0.0 instead of NaN / inf / -1e14.

  Source: standard RL diagnostic (e.g. OpenAI baselines `explained_variance`);
  the SAO paper reports EV ~ 0.6 for its critic.

  Args:
    values: `[B, T]` float, critic predictions.
    returns: `[B, T]` float, targets.
    action_mask: `[B, T]`, any dtype; non-zero on policy-generated tokens.

  Returns:
    Scalar in `result_type(values, returns, float32)`; no gradient.

  Raises:
    AssertionError (from chex) on arrays that are not rank 2, differ in shape,
    or (values / returns) are not floating.
  """
  chex.assert_rank([values, returns, action_mask], 2)
  chex.assert_equal_shape([values, returns, action_mask])
  chex.assert_type([values, returns], float)
  dtype = float_dtype(values, returns)
  is_action = jnp.asarray(action_mask).astype(bool)
  denom = jnp.maximum(jnp.sum(is_action, dtype=dtype), 1.0)
  values = jax.lax.stop_gradient(values.astype(dtype))
  returns = jax.lax.stop_gradient(returns.astype(dtype))

  def _masked_var(x):
    x = jnp.where(is_action, x, 0.0)
    mean = jnp.sum(x) / denom
    return jnp.sum(jnp.where(is_action, jnp.square(x - mean), 0.0)) / denom

  var_r = _masked_var(returns)
  var_res = _masked_var(returns - values)
  defined = var_r > EV_MIN_RETURN_VAR
  safe_var_r = jnp.where(defined, var_r, 1.0)
  return jnp.where(defined, 1.0 - var_res / safe_var_r, 0.0).astype(dtype)
