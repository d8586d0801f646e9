"""Advantage estimators for SAO: skip-observation GAE and the length-adaptive lambda.

Pure JAX kernels, no state and no I/O. Layout is token-major and padded,
`[batch, time]`, response tokens only; `action_mask` is non-zero on tokens the
policy generated and zero on environment observations and padding.
"""

from typing import Optional, Tuple

import chex
import jax
import jax.numpy as jnp

Array = chex.Array
Numeric = chex.Numeric


def float_dtype(*arrays: Array) -> jnp.dtype:
  """The compute dtype of the algo kernels: the floating inputs' result type, at least float32
  (float64 stays float64; bf16 / f16 are upcast); None and non-float inputs are ignored."""
  dtypes = [jnp.asarray(a).dtype for a in arrays if a is not None]
  dtypes = [d for d in dtypes if jnp.issubdtype(d, jnp.floating)]
  return jnp.result_type(*dtypes, jnp.float32)


def skip_observation_gae(
    rewards: Array,
    values: Array,
    action_mask: Array,
    gamma: Numeric,
    lam: Numeric,
    bootstrap_value: Optional[Array] = None,
) -> Tuple[Array, Array]:
  """Token-level GAE whose recursion jumps over observation tokens.

  For an action token t, let n(t) be the next action token of the same row
  (the environment's observation tokens in between are skipped):

    delta_t = r_t + gamma * V_{n(t)} - V_t
    A_t     = delta_t + gamma * lam * A_{n(t)}
    R_t     = A_t + V_t                                   (critic target)

  with V_{n(t)} = bootstrap_value (default 0, i.e. terminal) and A_{n(t)} = 0
  past the last action token. Off action positions A = R = 0. With an all-ones
  `action_mask` this is exactly standard truncated GAE.

  Implemented as one reverse `jax.lax.scan` over time (on the transposed
  `[T, B]` arrays) whose carry `(V_next_action, A_next_action)` per row passes
  unchanged through non-action positions. Hence:
    * values at observation / padding positions never influence anything
      (they are selected away with `jnp.where`; even inf / NaN is harmless);
    * rewards at non-action positions are IGNORED. Place the reward on the last
      action token (the project convention), never on observation tokens.
  No `stop_gradient` is applied; callers usually treat the outputs as targets.

  Sources: GAE, Schulman et al. 2016 ("High-Dimensional Continuous Control
  Using Generalized Advantage Estimation"); skip-observation token-level GAE,
  SAO paper (Hou, Li, Tang, Dong, 2026).

  Args:
    rewards: `[B, T]` float, r_t is the reward received after action token t.
    values: `[B, T]` float, critic values V_t.
    action_mask: `[B, T]`, any dtype; non-zero on policy-generated tokens.
    gamma: discount, python float or scalar (project default 1.0).
    lam: GAE lambda, python float, scalar, or per-row array `[B]` (e.g. from
      `length_adaptive_lambda`).
    bootstrap_value: optional `[B]` float, V used past the last action token
      of each row (truncated trajectories). None means 0 (terminal).

  Returns:
    `(advantages, returns)`, both `[B, T]` in `result_type(rewards, values,
    float32)`; zero at non-action positions.

  Raises:
    AssertionError (from chex) if rewards / values / action_mask are not rank 2
    or differ in shape, rewards / values are not floating, gamma is not a
    scalar, lam is not a scalar or `[B]`, or bootstrap_value is not `[B]`.
  """
  chex.assert_rank([rewards, values, action_mask], 2)
  chex.assert_equal_shape([rewards, values, action_mask])
  chex.assert_type([rewards, values], float)
  chex.assert_rank(gamma, 0)
  chex.assert_rank(lam, {0, 1})
  batch = rewards.shape[0]
  dtype = float_dtype(rewards, values)

  lam = jnp.asarray(lam, dtype)
  if lam.ndim == 1:
    chex.assert_shape(lam, (batch,))
  lam = jnp.broadcast_to(lam, (batch,))
  gamma = jnp.asarray(gamma, dtype)
  if bootstrap_value is None:
    next_value = jnp.zeros((batch,), dtype)
  else:
    chex.assert_shape(bootstrap_value, (batch,))
    next_value = jnp.asarray(bootstrap_value, dtype)
  next_adv = jnp.zeros((batch,), dtype)

  is_action = jnp.asarray(action_mask).astype(bool)
  xs = (rewards.astype(dtype).T, values.astype(dtype).T, is_action.T)

  def _step(carry, x):
    v_next, a_next = carry
    r_t, v_t, m_t = x
    delta = r_t + gamma * v_next - v_t
    a_t = delta + gamma * lam * a_next
    carry = (jnp.where(m_t, v_t, v_next), jnp.where(m_t, a_t, a_next))
    out = (jnp.where(m_t, a_t, 0.0), jnp.where(m_t, a_t + v_t, 0.0))
    return carry, out

  _, (adv_tb, ret_tb) = jax.lax.scan(
      _step, (next_value, next_adv), xs, reverse=True)
  return adv_tb.T, ret_tb.T


def length_adaptive_lambda(
    action_token_counts: Array,
    alpha: Numeric = 1.5,
) -> Array:
  """Length-adaptive GAE lambda for the policy.

    lam = clip(1 - 1 / (alpha * l), 0, 1),   and lam = 0 where l = 0

  `l` is the number of action tokens in the trajectory (no division by zero
  for empty rows). Longer trajectories get lambda closer to 1. The critic's
  targets use lam = 1 instead.

  Source: VAPO (Yue et al. 2025), as used by the SAO paper with alpha = 1.5.

  Args:
    action_token_counts: token counts, any shape (usually `[B]`), int or float.
    alpha: positive scale, python float or scalar (default 1.5).

  Returns:
    lambda with the shape of `action_token_counts`, floating (the input's float
    dtype, or the default float dtype for integer input).

  Raises:
    ValueError if `alpha` is a python number <= 0.
  """
  if isinstance(alpha, (int, float)) and alpha <= 0:
    raise ValueError(f'alpha must be > 0, got {alpha}.')
  chex.assert_rank(alpha, 0)
  counts = jnp.asarray(action_token_counts)
  if not jnp.issubdtype(counts.dtype, jnp.floating):
    counts = counts.astype(jnp.result_type(float))
  positive = counts > 0
  safe = jnp.where(positive, counts, 1.0)
  lam = jnp.clip(1.0 - 1.0 / (jnp.asarray(alpha, counts.dtype) * safe), 0.0, 1.0)
  return jnp.where(positive, lam, 0.0).astype(counts.dtype)
