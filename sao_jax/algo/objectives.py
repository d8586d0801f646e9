"""Policy objectives of the SAO algorithm family, one function each, one signature, one metric
vocabulary.

Every objective has the signature

  fn(logprobs, rollout_logprobs, advantages, action_mask, *, <its own knobs>,
     old_logprobs=None, aggregation='token_mean', norm_constant=None,
     ref_logprobs=None, kl_coef=0.0, entropy=None, entropy_coef=0.0)
  -> (loss, metrics)

with `[B, T]` token-major padded arrays (response positions; `action_mask`
non-zero on tokens the policy sampled, zero on prompt / observation / padding):

  logprobs          log pi_theta(a_t), differentiated (bf16 / f32 / f64).
  rollout_logprobs  log pi_rollout(a_t), recorded by the inference engine when it
                    sampled the token (under stop_gradient).
  old_logprobs      log pi_old(a_t) of a *recomputed* old policy (the trainer's
                    weights before this update, evaluated by the trainer); None
                    means `stop_gradient(logprobs)`, which is exactly the
                    recomputed old policy when the batch gets one policy update
                    (the project's setting) and saves a forward pass.
  advantages        A_t (under stop_gradient).

Objectives (loss to minimise; per-token term l_t, then aggregated):

  dis_objective        SAO Eq. 1-3:  r = pi_theta / pi_rollout,
                       l_t = -r_t A_t  if 1-eps_low < r_t < 1+eps_high else 0.
  ppo_clip_objective   PPO (Schulman et al. 2017) against the recomputed old
                       policy with asymmetric clip-higher (DAPO, Yu et al. 2025):
                       r = pi_theta / pi_old,
                       l_t = -min(r A, clip(r, 1-eps_low, 1+eps_high) A);
                       optional dual-clip (Ye et al. 2020) for A < 0:
                       l_t = min(l_t, -dual_clip * A).
  tis_objective        PPO clip times the truncated importance weight
                       w_t = min(pi_old / pi_rollout, tis_cap) (stop-gradient),
                       correcting the engine-vs-trainer mismatch (Yao et al. 2025,
                       "Your efficient RL framework secretly brings you off-policy
                       RL training").
  icepop_objective     PPO clip times the IcePop mask
                       m_t = [icepop_low <= pi_old / pi_rollout <= icepop_high]
                       (Ling team 2025, Ring-1T "IcePop"): tokens whose engine and
                       trainer probabilities disagree too much give no gradient.
  reinforce_objective  plain policy gradient l_t = -A_t log pi_theta(a_t)
                       (Williams 1992); no ratio, no clip.

Aggregation of l_t (`aggregation`):
  'token_mean'  sum_t l_t m_t / max(sum_t m_t, 1)                (default; SAO)
  'seq_mean'    mean over rows with >= 1 action token of the row's token mean
  'sum_norm'    sum_t l_t m_t / norm_constant        (Dr. GRPO; constant > 0)
Masked (clipped) tokens stay in every denominator.

Optional terms (default off; Python-level, so off means not even traced):
  kl_coef * agg(k3),  k3 = (q - 1) - log q, q = pi_ref/pi_theta: an estimate of KL(pi_theta ||
      pi_ref) on tokens sampled from pi; as a loss its gradient is that of KL(pi_ref || pi_theta)
  -entropy_coef * agg(entropy)          (`entropy`: per-token policy entropy)

Metrics (scalars, no gradient, identical keys for every objective):
  masked_fraction            action tokens whose gradient the clip / band / mask
                             zeroes, / action tokens
  masked_fraction_low/high   ... because the ratio was too low / too high
  masked_fraction_pos_adv    ... with A > 0 (/ all action tokens)
  masked_fraction_neg_adv    ... with A < 0 (/ all action tokens)
  ratio_mean/min/max         the objective's ratio (DIS: vs rollout; PPO family:
                             vs old; REINFORCE: pi_theta / pi_rollout, reported only)
  ess_fraction               (sum w)^2 / (n sum w^2) of the effective per-token
                             weights w multiplying A in the gradient (1 = uniform)
  abs_logp_diff_mean         mean |logp - logp_rollout|   (current vs rollout)
  approx_kl_k3               mean k3 with r = pi_theta / pi_rollout
  mismatch_abs_logp          mean |logp_old - logp_rollout|  (engine vs trainer)
  mismatch_exp_abs_minus_1   mean exp(|logp_old - logp_rollout|) - 1
  mismatch_kl_k3             mean k3 with r = pi_old / pi_rollout
  entropy                    mean entropy (0 when `entropy` is None)
  kl_ref                     mean k3(pi_ref || pi_theta) (0 when no ref_logprobs)
  advantage_mean/std         over action tokens (population std)
  tis_weight_mean, icepop_masked_fraction   (always present; 1 / 0 when unused)
All means are over action tokens; a batch without action tokens gives loss 0 and
all-zero metrics (ess_fraction 0, ratio_min 0). Log-ratios are zeroed off actions
and clipped to [-20, 20] before `exp`, so |log-ratio| ~ 1e4 stays finite; the
loss is computed in `result_type(inputs, float32)` (bf16 in -> float32 out).
"""

from typing import Callable, Dict, Optional, Tuple

import chex
import jax
import jax.numpy as jnp

from sao_jax.algo.advantages import float_dtype

Array = chex.Array
Numeric = chex.Numeric

LOG_RATIO_CLIP = 20.0
AGGREGATIONS = ('token_mean', 'seq_mean', 'sum_norm')


def _safe_exp(log_ratio: Array) -> Array:
  return jnp.exp(jnp.clip(log_ratio, -LOG_RATIO_CLIP, LOG_RATIO_CLIP))


def aggregate(per_token: Array, action_mask: Array, aggregation: str = 'token_mean',
              norm_constant: Optional[Numeric] = None) -> Array:
  """Reduces a per-token loss `[B, T]` to a scalar over action tokens.

    token_mean: sum(l * m) / max(sum(m), 1)
    seq_mean:   (1 / max(#rows with actions, 1)) * sum_rows sum_t(l m) / max(sum_t m, 1)
    sum_norm:   sum(l * m) / norm_constant        (Dr. GRPO, Liu et al. 2025)

  Args:
    per_token: `[B, T]` float; values off actions are ignored (`jnp.where`, so
      inf / NaN there cannot leak).
    action_mask: `[B, T]`, any dtype; non-zero on action tokens.
    aggregation: one of `AGGREGATIONS`.
    norm_constant: positive python number; required by 'sum_norm' only.

  Returns:
    Scalar in `per_token.dtype`.

  Raises:
    ValueError on an unknown `aggregation` or a missing / non-positive
    `norm_constant` for 'sum_norm'.
  """
  is_action = jnp.asarray(action_mask).astype(bool)
  x = jnp.where(is_action, per_token, 0.0)
  dtype = x.dtype
  if aggregation == 'token_mean':
    return jnp.sum(x) / jnp.maximum(jnp.sum(is_action, dtype=dtype), 1.0)
  if aggregation == 'seq_mean':
    counts = jnp.sum(is_action, axis=-1, dtype=dtype)
    row_mean = jnp.sum(x, axis=-1) / jnp.maximum(counts, 1.0)
    rows = jnp.sum(counts > 0, dtype=dtype)
    return jnp.sum(row_mean) / jnp.maximum(rows, 1.0)
  if aggregation == 'sum_norm':
    if norm_constant is None or not norm_constant > 0:
      raise ValueError("aggregation='sum_norm' needs norm_constant > 0 (e.g. the maximum "
                       f"response length); got {norm_constant!r}. Set train.loss_norm_constant.")
    return jnp.sum(x) / jnp.asarray(norm_constant, dtype)
  raise ValueError(f'unknown aggregation {aggregation!r}; use one of {AGGREGATIONS} '
                   '(train.aggregation).')


def _k3(log_q_over_p: Array) -> Array:
  """k3 = (q/p - 1) - log(q/p) >= 0, from log(q/p) (clipped for finiteness)."""
  c = jnp.clip(log_q_over_p, -LOG_RATIO_CLIP, LOG_RATIO_CLIP)
  return jnp.exp(c) - 1.0 - c


def _finish(*, per_token: Array, is_action: Array, zeroed: Array, zeroed_low: Array,
            zeroed_high: Array, ratio: Array, weight: Array, logprobs: Array,
            old_logprobs: Array, rollout_logprobs: Array, advantages: Array,
            aggregation: str, norm_constant, ref_logprobs, kl_coef, entropy, entropy_coef,
            tis_weight: Optional[Array] = None, icepop_masked: Optional[Array] = None,
            ) -> Tuple[Array, Dict[str, Array]]:
  """Aggregation, optional KL / entropy terms and the shared metric vocabulary."""
  dtype = per_token.dtype
  loss = aggregate(per_token, is_action, aggregation, norm_constant)
  kl_ref_tok = None
  if ref_logprobs is not None:
    ref = jax.lax.stop_gradient(jnp.asarray(ref_logprobs).astype(dtype))
    kl_ref_tok = _k3(jnp.where(is_action, ref - logprobs, 0.0))
    if kl_coef:
      loss = loss + kl_coef * aggregate(kl_ref_tok, is_action, aggregation, norm_constant)
  elif kl_coef:
    raise ValueError('kl_coef > 0 needs ref_logprobs (the reference policy log-probs).')
  ent = None
  if entropy is not None:
    ent = jnp.where(is_action, jnp.asarray(entropy).astype(dtype), 0.0)
    if entropy_coef:
      loss = loss - entropy_coef * aggregate(ent, is_action, aggregation, norm_constant)
  elif entropy_coef:
    raise ValueError('entropy_coef > 0 needs the per-token entropy.')

  sg = jax.lax.stop_gradient
  n = jnp.sum(is_action, dtype=dtype)
  denom = jnp.maximum(n, 1.0)
  has = n > 0

  def mean(x):
    return jnp.sum(jnp.where(is_action, sg(x), 0.0)) / denom

  def frac(b):
    return mean(b.astype(dtype))

  ratio = sg(ratio)
  w = jnp.where(is_action, sg(weight), 0.0)
  ess = jnp.square(jnp.sum(w)) / jnp.maximum(n * jnp.sum(jnp.square(w)), jnp.finfo(dtype).tiny)
  cur = sg(jnp.where(is_action, logprobs - rollout_logprobs, 0.0))
  old = jnp.where(is_action, old_logprobs - rollout_logprobs, 0.0)
  abs_old = jnp.minimum(jnp.abs(old), LOG_RATIO_CLIP)
  adv_mean = mean(advantages)
  adv_var = mean(jnp.square(advantages - adv_mean))
  metrics = {
      'masked_fraction': frac(zeroed),
      'masked_fraction_low': frac(zeroed_low),
      'masked_fraction_high': frac(zeroed_high),
      'masked_fraction_pos_adv': frac(zeroed & (advantages > 0)),
      'masked_fraction_neg_adv': frac(zeroed & (advantages < 0)),
      'ratio_mean': mean(ratio),
      'ratio_min': jnp.where(has, jnp.min(jnp.where(is_action, ratio, jnp.inf)), 0.0),
      'ratio_max': jnp.max(jnp.where(is_action, ratio, 0.0)),
      'ess_fraction': jnp.where(has, ess, 0.0),
      'abs_logp_diff_mean': mean(jnp.abs(cur)),
      'approx_kl_k3': mean(_k3(cur)),
      'mismatch_abs_logp': mean(jnp.abs(old)),
      'mismatch_exp_abs_minus_1': mean(jnp.exp(abs_old) - 1.0),
      'mismatch_kl_k3': mean(_k3(old)),
      'entropy': mean(ent) if ent is not None else jnp.zeros((), dtype),
      'kl_ref': mean(kl_ref_tok) if kl_ref_tok is not None else jnp.zeros((), dtype),
      'advantage_mean': adv_mean,
      'advantage_std': jnp.sqrt(adv_var),
      'tis_weight_mean': (mean(tis_weight) if tis_weight is not None
                          else jnp.where(has, 1.0, 0.0).astype(dtype)),
      'icepop_masked_fraction': (frac(icepop_masked) if icepop_masked is not None
                                 else jnp.zeros((), dtype)),
  }
  metrics = {k: v.astype(dtype) for k, v in metrics.items()}
  return loss.astype(dtype), metrics


def _prepare(logprobs, rollout_logprobs, advantages, action_mask, old_logprobs):
  chex.assert_rank([logprobs, rollout_logprobs, advantages, action_mask], 2)
  chex.assert_equal_shape([logprobs, rollout_logprobs, advantages, action_mask])
  chex.assert_type([logprobs, rollout_logprobs, advantages], float)
  if old_logprobs is not None:
    chex.assert_equal_shape([logprobs, old_logprobs])
    chex.assert_type(old_logprobs, float)
  dtype = float_dtype(logprobs, rollout_logprobs, advantages, old_logprobs)
  sg = jax.lax.stop_gradient
  is_action = jnp.asarray(action_mask).astype(bool)
  logprobs = logprobs.astype(dtype)
  rollout = sg(rollout_logprobs.astype(dtype))
  adv = sg(jnp.where(is_action, advantages.astype(dtype), 0.0))
  old = sg(logprobs) if old_logprobs is None else sg(old_logprobs.astype(dtype))
  return is_action, logprobs, rollout, adv, old


def _check_band(eps_low, eps_high, name='eps'):
  if isinstance(eps_low, (int, float)) and not 0.0 <= eps_low < 1.0:
    raise ValueError(f'{name}_low must be in [0, 1), got {eps_low}.')
  if isinstance(eps_high, (int, float)) and not eps_high > 0.0:
    raise ValueError(f'{name}_high must be > 0, got {eps_high}.')


_COMMON_DOC = """
  Common arguments (see the module docstring): logprobs, rollout_logprobs,
  advantages `[B, T]` float; action_mask `[B, T]` any dtype; old_logprobs
  optional `[B, T]` float; aggregation / norm_constant; ref_logprobs + kl_coef;
  entropy + entropy_coef.

  Returns `(loss, metrics)`: scalar loss and the shared metric dict, all in
  `result_type(inputs, float32)`.

  Raises AssertionError (chex) on rank / shape / dtype errors, ValueError on bad
  band parameters, aggregation, or a coefficient without its input.
"""


def dis_objective(logprobs: Array, rollout_logprobs: Array, advantages: Array,
                  action_mask: Array, *, eps_low: Numeric = 0.3, eps_high: Numeric = 5.0,
                  old_logprobs: Optional[Array] = None, aggregation: str = 'token_mean',
                  norm_constant=None, ref_logprobs=None, kl_coef: float = 0.0,
                  entropy=None, entropy_coef: float = 0.0):
  """SAO direct double-sided importance sampling (SAO paper Eq. 1-3).

    r_t = exp(logp_t - logp_rollout_t);  keep_t = 1-eps_low < r_t < 1+eps_high (strict)
    l_t = -r_t A_t keep_t

  With the defaults this is `tests/dis_reference.py:dis_policy_loss` (the first implementation,
  kept as a test oracle) exactly (same numbers); `old_logprobs` only feeds the mismatch metrics.
  """ + _COMMON_DOC
  _check_band(eps_low, eps_high)
  is_action, lp, rollout, adv, old = _prepare(logprobs, rollout_logprobs, advantages,
                                              action_mask, old_logprobs)
  dtype = lp.dtype
  ratio = _safe_exp(jnp.where(is_action, lp - rollout, 0.0))
  low = 1.0 - jnp.asarray(eps_low, dtype)
  high = 1.0 + jnp.asarray(eps_high, dtype)
  keep = is_action & (ratio > low) & (ratio < high)
  per_token = jnp.where(keep, -ratio * adv, 0.0)
  sg_ratio = jax.lax.stop_gradient(ratio)
  return _finish(per_token=per_token, is_action=is_action, zeroed=is_action & ~keep,
                 zeroed_low=sg_ratio <= low, zeroed_high=sg_ratio >= high, ratio=ratio,
                 weight=jnp.where(keep, ratio, 0.0), logprobs=lp, old_logprobs=old,
                 rollout_logprobs=rollout, advantages=adv, aggregation=aggregation,
                 norm_constant=norm_constant, ref_logprobs=ref_logprobs, kl_coef=kl_coef,
                 entropy=entropy, entropy_coef=entropy_coef)


def _ppo_core(lp, old, adv, is_action, eps_low, eps_high, dual_clip):
  """Per-token PPO clip loss and which tokens have a zeroed gradient (low / high side)."""
  dtype = lp.dtype
  ratio = _safe_exp(jnp.where(is_action, lp - old, 0.0))
  low = 1.0 - jnp.asarray(eps_low, dtype)
  high = 1.0 + jnp.asarray(eps_high, dtype)
  unclipped = ratio * adv
  clipped = jnp.clip(ratio, low, high) * adv
  per_token = -jnp.minimum(unclipped, clipped)
  r = jax.lax.stop_gradient(ratio)
  # The clipped branch (constant in theta) is active: r beyond the bound in the direction A pushes.
  zeroed_high = is_action & (adv > 0) & (r > high)
  zeroed_low = is_action & (adv < 0) & (r < low)
  if dual_clip is not None:
    if isinstance(dual_clip, (int, float)) and not dual_clip > 1.0:
      raise ValueError(f'dual_clip must be > 1 (e.g. 3.0) or None, got {dual_clip}.')
    cap = -jnp.asarray(dual_clip, dtype) * adv
    dual_active = is_action & (adv < 0) & (per_token > cap)
    per_token = jnp.where(adv < 0, jnp.minimum(per_token, cap), per_token)
    zeroed_high = zeroed_high | dual_active
  zeroed = zeroed_low | zeroed_high
  # d l / d logp = -A * weight: the gradient weight is r where the unclipped branch is active.
  weight = jnp.where(zeroed, 0.0, ratio)
  return ratio, per_token, zeroed, zeroed_low, zeroed_high, weight


def ppo_clip_objective(logprobs: Array, rollout_logprobs: Array, advantages: Array,
                       action_mask: Array, *, eps_low: Numeric = 0.2, eps_high: Numeric = 0.28,
                       dual_clip: Optional[Numeric] = None,
                       old_logprobs: Optional[Array] = None, aggregation: str = 'token_mean',
                       norm_constant=None, ref_logprobs=None, kl_coef: float = 0.0,
                       entropy=None, entropy_coef: float = 0.0):
  """PPO clip against the recomputed old policy, clip-higher, optional dual-clip.

    r_t = exp(logp_t - logp_old_t)
    l_t = -min(r_t A_t, clip(r_t, 1-eps_low, 1+eps_high) A_t)
    dual-clip (A_t < 0 only): l_t = min(l_t, -dual_clip A_t)

  Sources: PPO, Schulman et al. 2017, Eq. 7; clip-higher, DAPO (Yu et al. 2025);
  dual-clip, Ye et al. 2020 (Mastering Complex Control in MOBA Games). The
  rollout log-probs play no part in the loss (this is the "no DIS" baseline);
  they feed the mismatch / approx-KL metrics only.
  """ + _COMMON_DOC
  _check_band(eps_low, eps_high)
  is_action, lp, rollout, adv, old = _prepare(logprobs, rollout_logprobs, advantages,
                                              action_mask, old_logprobs)
  ratio, per_token, zeroed, zlow, zhigh, weight = _ppo_core(lp, old, adv, is_action, eps_low,
                                                            eps_high, dual_clip)
  return _finish(per_token=per_token, is_action=is_action, zeroed=zeroed, zeroed_low=zlow,
                 zeroed_high=zhigh, ratio=ratio, weight=weight, logprobs=lp, old_logprobs=old,
                 rollout_logprobs=rollout, advantages=adv, aggregation=aggregation,
                 norm_constant=norm_constant, ref_logprobs=ref_logprobs, kl_coef=kl_coef,
                 entropy=entropy, entropy_coef=entropy_coef)


def tis_objective(logprobs: Array, rollout_logprobs: Array, advantages: Array,
                  action_mask: Array, *, tis_cap: Numeric = 2.0, eps_low: Numeric = 0.2,
                  eps_high: Numeric = 0.28, dual_clip: Optional[Numeric] = None,
                  old_logprobs: Optional[Array] = None, aggregation: str = 'token_mean',
                  norm_constant=None, ref_logprobs=None, kl_coef: float = 0.0,
                  entropy=None, entropy_coef: float = 0.0):
  """PPO clip times the truncated importance weight min(pi_old / pi_rollout, C).

    w_t = sg(min(exp(logp_old_t - logp_rollout_t), tis_cap))
    l_t = w_t * l^PPO_t

  Source: truncated importance sampling for the engine-vs-trainer mismatch, Yao
  et al. 2025 (fengyao.notion.site "off-policy RL"), after IMPALA's truncated
  weights (Espeholt et al. 2018).
  """ + _COMMON_DOC
  _check_band(eps_low, eps_high)
  if isinstance(tis_cap, (int, float)) and not tis_cap > 0:
    raise ValueError(f'tis_cap must be > 0 (e.g. 2.0), got {tis_cap}.')
  is_action, lp, rollout, adv, old = _prepare(logprobs, rollout_logprobs, advantages,
                                              action_mask, old_logprobs)
  ratio, per_token, zeroed, zlow, zhigh, weight = _ppo_core(lp, old, adv, is_action, eps_low,
                                                            eps_high, dual_clip)
  tis = jnp.minimum(_safe_exp(jnp.where(is_action, old - rollout, 0.0)),
                    jnp.asarray(tis_cap, lp.dtype))
  return _finish(per_token=tis * per_token, is_action=is_action, zeroed=zeroed, zeroed_low=zlow,
                 zeroed_high=zhigh, ratio=ratio, weight=tis * weight, logprobs=lp,
                 old_logprobs=old, rollout_logprobs=rollout, advantages=adv,
                 aggregation=aggregation, norm_constant=norm_constant, ref_logprobs=ref_logprobs,
                 kl_coef=kl_coef, entropy=entropy, entropy_coef=entropy_coef, tis_weight=tis)


def icepop_objective(logprobs: Array, rollout_logprobs: Array, advantages: Array,
                     action_mask: Array, *, icepop_low: Numeric = 0.5,
                     icepop_high: Numeric = 5.0, eps_low: Numeric = 0.2,
                     eps_high: Numeric = 0.28, dual_clip: Optional[Numeric] = None,
                     old_logprobs: Optional[Array] = None, aggregation: str = 'token_mean',
                     norm_constant=None, ref_logprobs=None, kl_coef: float = 0.0,
                     entropy=None, entropy_coef: float = 0.0):
  """PPO clip times the IcePop mask on the engine-vs-trainer probability ratio.

    rho_t = exp(logp_old_t - logp_rollout_t)
    m_t   = icepop_low <= rho_t <= icepop_high      (inclusive)
    l_t   = m_t * l^PPO_t

  Source: IcePop, Ling team 2025 (Ring-1T / "Every Step Evolves"), which masks
  tokens whose training / inference probabilities diverge (they use [0.5, 5]).
  """ + _COMMON_DOC
  _check_band(eps_low, eps_high)
  if (isinstance(icepop_low, (int, float)) and isinstance(icepop_high, (int, float))
      and not 0.0 <= icepop_low < 1.0 < icepop_high):
    raise ValueError('icepop band needs 0 <= icepop_low < 1 < icepop_high, got '
                     f'({icepop_low}, {icepop_high}).')
  is_action, lp, rollout, adv, old = _prepare(logprobs, rollout_logprobs, advantages,
                                              action_mask, old_logprobs)
  ratio, per_token, zeroed, zlow, zhigh, weight = _ppo_core(lp, old, adv, is_action, eps_low,
                                                            eps_high, dual_clip)
  rho = _safe_exp(jnp.where(is_action, old - rollout, 0.0))
  ok = (rho >= jnp.asarray(icepop_low, lp.dtype)) & (rho <= jnp.asarray(icepop_high, lp.dtype))
  ice_low, ice_high = is_action & (rho < icepop_low), is_action & (rho > icepop_high)
  return _finish(per_token=jnp.where(ok, per_token, 0.0), is_action=is_action,
                 zeroed=zeroed | ~ok, zeroed_low=zlow | ice_low, zeroed_high=zhigh | ice_high,
                 ratio=ratio, weight=jnp.where(ok, weight, 0.0), logprobs=lp, old_logprobs=old,
                 rollout_logprobs=rollout, advantages=adv, aggregation=aggregation,
                 norm_constant=norm_constant, ref_logprobs=ref_logprobs, kl_coef=kl_coef,
                 entropy=entropy, entropy_coef=entropy_coef, icepop_masked=is_action & ~ok)


def reinforce_objective(logprobs: Array, rollout_logprobs: Array, advantages: Array,
                        action_mask: Array, *, old_logprobs: Optional[Array] = None,
                        aggregation: str = 'token_mean', norm_constant=None, ref_logprobs=None,
                        kl_coef: float = 0.0, entropy=None, entropy_coef: float = 0.0):
  """Plain REINFORCE / policy gradient, no importance weight, no clip.

    l_t = -A_t logp_t          (d l_t / d logp_t = -A_t)

  Source: Williams 1992. `ratio_*` metrics report pi_theta / pi_rollout for
  diagnosis only; nothing is ever masked.
  """ + _COMMON_DOC
  is_action, lp, rollout, adv, old = _prepare(logprobs, rollout_logprobs, advantages,
                                              action_mask, old_logprobs)
  per_token = -adv * jnp.where(is_action, lp, 0.0)
  ratio = _safe_exp(jnp.where(is_action, lp - rollout, 0.0))
  none = jnp.zeros_like(is_action)
  return _finish(per_token=per_token, is_action=is_action, zeroed=none, zeroed_low=none,
                 zeroed_high=none, ratio=ratio, weight=jnp.ones_like(lp), logprobs=lp,
                 old_logprobs=old, rollout_logprobs=rollout, advantages=adv,
                 aggregation=aggregation, norm_constant=norm_constant, ref_logprobs=ref_logprobs,
                 kl_coef=kl_coef, entropy=entropy, entropy_coef=entropy_coef)


OBJECTIVES: Dict[str, Callable] = {
    'dis': dis_objective,
    'ppo_clip': ppo_clip_objective,
    'tis': tis_objective,
    'icepop': icepop_objective,
    'reinforce': reinforce_objective,
}


def get_objective(name: str) -> Callable:
  """The objective function called `name` (a key of `OBJECTIVES`).

  Raises ValueError naming `train.objective` and the valid choices."""
  if name not in OBJECTIVES:
    raise ValueError(f'unknown train.objective {name!r}; use one of {sorted(OBJECTIVES)}.')
  return OBJECTIVES[name]
