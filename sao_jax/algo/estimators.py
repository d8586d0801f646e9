"""Advantage estimators of the SAO algorithm family beyond skip-observation GAE.

Pure JAX (no state, no I/O). Token-major padded layout `[B, T]`; `action_mask`
non-zero on tokens the policy sampled. Rewards sit on each row's last action
token (project convention).

  naive_token_gae        token GAE whose recursion runs THROUGH observation
                         tokens (the common bug; ablation of skip-observation GAE)
  step_level_gae         one value per turn (mean or last token of the turn),
                         GAE over turns (SAO paper appendix, step-level variant)
  group_normalized_advantages  group-normalised outcome advantages (DeepSeekMath GRPO),
                         with or without the std division (Dr. GRPO), groups by id
  broadcast_to_tokens    a per-row advantage `[B]` onto that row's action tokens

`ESTIMATORS` maps every name a config may give (`train.advantage_estimator`) to an
`Estimator`: a new estimator is one function, one registry line and its test.
Stateful running-mean windows live in `sao_jax.train.baselines` (host side); the
learner passes their baseline per row, and the kernel here subtracts it.
"""

import dataclasses
from typing import Callable, Optional, Tuple

import chex
import jax
import jax.numpy as jnp

from sao_jax.algo.advantages import float_dtype, skip_observation_gae

Array = chex.Array
Numeric = chex.Numeric


def response_span(action_mask: Array) -> Array:
  """Boolean `[B, T]`: True from each row's first to its last action token (inclusive).

  Observation tokens between two turns are inside the span; prompt and trailing
  padding are not. Rows without actions are all False."""
  is_action = jnp.asarray(action_mask).astype(bool)
  seen_before = jnp.cumsum(is_action, axis=-1) > 0
  seen_after = jnp.flip(jnp.cumsum(jnp.flip(is_action, -1), axis=-1), -1) > 0
  return seen_before & seen_after


def naive_token_gae(rewards: Array, values: Array, action_mask: Array, gamma: Numeric,
                    lam: Numeric, bootstrap_value: Optional[Array] = None
                    ) -> Tuple[Array, Array]:
  """Token GAE that treats observation tokens as ordinary time steps (the common bug).

  Over the span from the first to the last action token of a row, every position
  t (action or observation) is a step:

    delta_t = r_t + gamma V_{t+1} - V_t,   A_t = delta_t + gamma lam A_{t+1}

  so an action token bootstraps from the critic's value on the next *observation*
  token, and gamma / lam decay across observation tokens. Outputs are then zeroed
  off action tokens. Equals `skip_observation_gae` when a row has no observation
  inside its span (the hypothesis test checks this).

  Source: the ablation of the SAO paper's skip-observation token GAE.

  Args / returns / raises: as `advantages.skip_observation_gae` (`[B, T]` in,
  `(advantages, returns)` `[B, T]` out, zero off actions).
  """
  span = response_span(action_mask)
  adv, ret = skip_observation_gae(rewards, values, span, gamma, lam, bootstrap_value)
  is_action = jnp.asarray(action_mask).astype(bool)
  return jnp.where(is_action, adv, 0.0), jnp.where(is_action, ret, 0.0)


def turn_index(action_mask: Array) -> Tuple[Array, Array]:
  """Turn id of every action token: turns are maximal runs of consecutive action tokens.

  Returns `(turn_id, num_turns)`: int32 `[B, T]` (0-based on action tokens, -1
  elsewhere) and int32 `[B]`."""
  is_action = jnp.asarray(action_mask).astype(bool)
  prev = jnp.pad(is_action[:, :-1], ((0, 0), (1, 0)))
  starts = is_action & ~prev
  tid = jnp.cumsum(starts, axis=-1, dtype=jnp.int32) - 1
  return jnp.where(is_action, tid, -1), jnp.sum(starts, axis=-1, dtype=jnp.int32)


def step_level_gae(rewards: Array, values: Array, action_mask: Array, gamma: Numeric,
                   lam: Numeric, value_reduction: str = 'mean',
                   bootstrap_value: Optional[Array] = None) -> Tuple[Array, Array]:
  """Step-level (turn-level) GAE: one value and one advantage per turn.

  A turn k is a maximal run of consecutive action tokens. With
    R_k = sum of rewards on turn k's tokens,
    V_k = mean of V_t over turn k's tokens      (value_reduction='mean'), or
          V_t at turn k's last token             (value_reduction='last'),
    delta_k = R_k + gamma V_{k+1} - V_k,  A_k = delta_k + gamma lam A_{k+1}
  (V = A = 0 past the last turn, or V = bootstrap_value), every token of turn k
  gets advantage A_k and return A_k + V_k. Zero off action tokens.

  Source: SAO paper appendix (token- vs step-level GAE; average and last-token
  value variants).

  Args:
    rewards, values: `[B, T]` float; action_mask: `[B, T]` any dtype.
    gamma: scalar; lam: scalar or `[B]`.
    value_reduction: 'mean' or 'last'.
    bootstrap_value: optional `[B]`.

  Returns:
    `(advantages, returns)`, `[B, T]`, `result_type(rewards, values, float32)`.

  Raises:
    ValueError on an unknown `value_reduction`; AssertionError (chex) on shapes.
  """
  if value_reduction not in ('mean', 'last'):
    raise ValueError(f"value_reduction must be 'mean' or 'last', got {value_reduction!r} "
                     '(train.advantage_estimator step_gae_mean / step_gae_last).')
  chex.assert_rank([rewards, values, action_mask], 2)
  chex.assert_equal_shape([rewards, values, action_mask])
  dtype = float_dtype(rewards, values)
  b, t = rewards.shape
  is_action = jnp.asarray(action_mask).astype(bool)
  tid, num_turns = turn_index(is_action)
  seg = jnp.where(is_action, tid, t)  # off-action tokens go to a dropped segment
  r = jnp.where(is_action, rewards.astype(dtype), 0.0)
  v = jnp.where(is_action, values.astype(dtype), 0.0)

  def per_row(seg_r, r_r, v_r, m_r):
    turn_r = jax.ops.segment_sum(r_r, seg_r, num_segments=t + 1)[:t]
    count = jax.ops.segment_sum(m_r.astype(dtype), seg_r, num_segments=t + 1)[:t]
    if value_reduction == 'mean':
      turn_v = jax.ops.segment_sum(v_r, seg_r, num_segments=t + 1)[:t] / jnp.maximum(count, 1.0)
    else:
      nxt = jnp.pad(m_r[1:], (0, 1))
      is_last = m_r & ~nxt
      turn_v = jax.ops.segment_sum(jnp.where(is_last, v_r, 0.0), seg_r, num_segments=t + 1)[:t]
    return turn_r, turn_v

  turn_r, turn_v = jax.vmap(per_row)(seg, r, v, is_action)
  turn_mask = jnp.arange(t)[None, :] < num_turns[:, None]
  adv_k, ret_k = skip_observation_gae(turn_r, turn_v, turn_mask, gamma, lam, bootstrap_value)
  safe = jnp.clip(tid, 0, t - 1)
  adv = jnp.where(is_action, jnp.take_along_axis(adv_k, safe, axis=-1), 0.0)
  ret = jnp.where(is_action, jnp.take_along_axis(ret_k, safe, axis=-1), 0.0)
  return adv, ret


def broadcast_to_tokens(row_advantages: Array, action_mask: Array) -> Array:
  """`[B]` per-trajectory advantages onto each row's action tokens -> `[B, T]` (0 elsewhere)."""
  chex.assert_rank([row_advantages, action_mask], [1, 2])
  chex.assert_equal_shape_prefix([row_advantages, action_mask], 1)
  dtype = float_dtype(row_advantages)
  is_action = jnp.asarray(action_mask).astype(bool)
  return jnp.where(is_action, jnp.asarray(row_advantages, dtype)[:, None], 0.0)


def group_normalized_advantages(reward: Array, group_id: Array, normalize_std: bool = True,
                                eps: Numeric = 1e-6) -> Array:
  """GRPO advantages for rows in any order, groups given by id (jit-friendly).

    A_i = (r_i - mean_g r) / (std_g r + eps)   (normalize_std)
    A_i =  r_i - mean_g r                      (otherwise)

  over the rows sharing row i's `group_id` g; `std` is the population standard deviation
  (ddof = 0), so a group whose rewards are all equal gets A = 0 (no NaN). Rows with
  `group_id < 0` (padding) form one extra group.
  Sources: GRPO, Shao et al. 2024 (DeepSeekMath) §4.1.2; without the std division, Dr. GRPO
  (Liu et al. 2025).

  Args:
    reward: `[B]` float, one outcome reward per row.
    group_id: int `[B]`, in `[-1, B)`.
    normalize_std: divide by the group std.
    eps: added to the std.

  Returns:
    `[B]` per-row advantages, at least float32.
  """
  chex.assert_rank([reward, group_id], 1)
  dtype = float_dtype(reward)
  r = jnp.asarray(reward).astype(dtype)
  n = r.shape[0]
  gid = jnp.where(group_id >= 0, group_id, n)
  count = jnp.maximum(jax.ops.segment_sum(jnp.ones_like(r), gid, n + 1), 1.0)
  centred = r - (jax.ops.segment_sum(r, gid, n + 1) / count)[gid]
  if not normalize_std:
    return centred
  std = jnp.sqrt(jax.ops.segment_sum(centred * centred, gid, n + 1) / count)[gid]
  return centred / (std + jnp.asarray(eps, dtype))


def baseline_advantages(reward: Array, baseline: Array) -> Array:
  """`reward - baseline` per row `[B]` (running-mean baselines; the window is host state,
  `sao_jax.train.baselines.RunningMeanBaseline`). Source: SAO paper, running-mean ablation."""
  chex.assert_rank([reward, baseline], 1)
  dtype = float_dtype(reward, baseline)
  return jnp.asarray(reward, dtype) - jnp.asarray(baseline, dtype)


@dataclasses.dataclass(frozen=True)
class Estimator:
  """One entry of `ESTIMATORS`.

  Attributes:
    fn: with `uses_critic`, `fn(rewards, values, action_mask, gamma, lam, bootstrap_value)
      -> (advantages, returns)`, all `[B, T]` (rewards on each row's last action token);
      without, `fn(reward [B], group_id int32 [B], baseline [B], eps) -> advantages [B]`
      (broadcast onto each row's action tokens by the learner).
    uses_critic: needs critic values (the learner runs K critic updates per policy step).
    values_on_span: the critic's values are read on observation tokens inside the response
      too (naive GAE); otherwise on action tokens only.
    needs_groups: needs complete groups of `train.group_size` rollouts of one prompt (GRPO).
    baseline_window: None, or "prompt" / "global": the learner keeps a running-mean window of
      that kind (`train.baseline_window` / `train.global_baseline_window`) and fills the
      batch's `baseline`.
  """
  fn: Callable
  uses_critic: bool
  values_on_span: bool = False
  needs_groups: bool = False
  baseline_window: Optional[str] = None


def _row_estimator(kernel):
  return lambda reward, group_id, baseline, eps: kernel(reward, group_id, baseline, eps)


ESTIMATORS = {
    # SAO §3.3: token-level GAE that skips observation tokens (the default with a critic)
    'skip_obs_gae': Estimator(skip_observation_gae, uses_critic=True),
    # ablation: GAE through observation tokens
    'naive_gae': Estimator(naive_token_gae, uses_critic=True, values_on_span=True),
    # SAO appendix: one value per turn (mean / last token of the turn)
    'step_gae_mean': Estimator(lambda r, v, m, g, l, b=None: step_level_gae(
        r, v, m, g, l, 'mean', b), uses_critic=True),
    'step_gae_last': Estimator(lambda r, v, m, g, l, b=None: step_level_gae(
        r, v, m, g, l, 'last', b), uses_critic=True),
    # DeepSeekMath GRPO / Dr. GRPO (no std division)
    'grpo': Estimator(_row_estimator(lambda r, g, b, eps: group_normalized_advantages(
        r, g, True, eps)), uses_critic=False, needs_groups=True),
    'grpo_no_std': Estimator(_row_estimator(lambda r, g, b, eps: group_normalized_advantages(
        r, g, False, eps)), uses_critic=False, needs_groups=True),
    # SAO ablation (last 8 rewards of the prompt) / online baseline (last 128 rewards)
    'running_mean_prompt': Estimator(_row_estimator(lambda r, g, b, eps: baseline_advantages(
        r, b)), uses_critic=False, baseline_window='prompt'),
    'running_mean_global': Estimator(_row_estimator(lambda r, g, b, eps: baseline_advantages(
        r, b)), uses_critic=False, baseline_window='global'),
}


def get_estimator(name: str) -> Estimator:
  """`ESTIMATORS[name]`; raises ValueError naming `train.advantage_estimator` and the valid
  names."""
  if name not in ESTIMATORS:
    raise ValueError(f'unknown train.advantage_estimator {name!r}; use one of '
                     f'{tuple(ESTIMATORS)} (or "auto" for the mode default).')
  return ESTIMATORS[name]
