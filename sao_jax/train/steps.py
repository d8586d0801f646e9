"""Pure train-step functions: advantage targets, critic (value) update, policy update, batch
metrics, and the SFT warm-up step.

The learner (``sao_jax.train.learner``) jits them with explicit shardings and donation; here
they are plain functions of ``(state, batch, ...) -> (state, metrics)``, following the Flax NNX
Gemma example: the model's ``graphdef`` is static and the params (a pure dict) are merged inside
the loss. ``batch`` is a ``sao_jax.train.batch.Batch``; index t of every ``[B, T]`` array refers
to token t, whose log-prob comes from the logits at position t-1 (token 0 is never an action).

``microbatches`` M > 1 accumulates gradients over M interleaved micro-batches in a
``lax.scan`` and gives the same loss and gradients as one pass over the whole batch (token means
use the whole batch's action-token count). ``constrain(x, kind)`` adds activation sharding
hints ("logits" [B, T, V], "tokens" [B, T]); the identity on one device.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct

from sao_jax import algo
from sao_jax.models.transformer import default_positions
from sao_jax.train.batch import Batch


@struct.dataclass
class TrainState:
  """params: pure dict; opt_state: optax state; step: int32 []."""
  params: Any
  opt_state: Any
  step: jax.Array

  @classmethod
  def create(cls, params, tx: optax.GradientTransformation) -> "TrainState":
    return cls(params=params, opt_state=tx.init(params), step=jnp.zeros((), jnp.int32))


def token_logprobs(logits: jax.Array, tokens: jax.Array, temperature: float = 1.0) -> jax.Array:
  """log softmax(logits[:, t-1] / temperature)[tokens[:, t]] for t >= 1; 0 at t = 0.

  logits float [B, T, V]; tokens int [B, T] -> float32 [B, T]."""
  logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32) / temperature, axis=-1)
  picked = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
  return jnp.pad(picked, ((0, 0), (1, 0)))


def shift_values(values: jax.Array) -> jax.Array:
  """Critic outputs at position t-1 are the values V(s_t) of the state before token t."""
  return jnp.pad(values[:, :-1], ((0, 0), (1, 0)))


def _global_norm(tree) -> jax.Array:
  return optax.tree.norm(tree).astype(jnp.float32)


def _no_constraint(x, kind):
  del kind
  return x


def split_microbatches(batch, microbatches: int):
  """[B, ...] arrays -> [M, B/M, ...]; micro-batch j holds rows j, j+M, j+2M, ...

  Interleaving (not contiguous blocks) keeps every micro-batch spread over all the devices that
  hold the batch's rows. Raises ValueError if B is not a multiple of M."""
  def split(x):
    b = x.shape[0]
    if b % microbatches:
      raise ValueError(f"batch of {b} rows does not split into {microbatches} parts "
                       "(train.policy_minibatches x the micro-batches planned from "
                       "mesh.tokens_per_device); make train.batch_size a multiple of them.")
    x = x.reshape((b // microbatches, microbatches) + x.shape[1:])
    return jnp.swapaxes(x, 0, 1)
  return jax.tree.map(split, batch)


def _value_and_grad(loss_fn, params, batch, microbatches: int = 1):
  """``value_and_grad(loss_fn, has_aux=True)(params, batch)``, optionally accumulated.

  ``batch`` is a pytree with the ``Batch`` under key "batch" (and per-token targets beside it);
  ``loss_fn(params, batch) -> (loss, metrics)`` must return token means over the batch's action
  tokens (``sum / max(n, 1)``, n = action tokens). With ``microbatches`` M > 1 each micro-batch's
  loss and metrics are re-weighted by ``max(n_j, 1) / max(N, 1)`` (N = whole batch) and summed,
  which equals the whole-batch token mean exactly in real arithmetic; metrics whose name contains
  "max" are maxima over micro-batches instead."""
  if microbatches == 1:
    return jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
  count = lambda b: jnp.maximum(b["batch"].action_mask.sum(dtype=jnp.float32), 1.0)
  total = count(batch)
  micro = split_microbatches(batch, microbatches)

  def weighted(p, mb):
    loss, metrics = loss_fn(p, mb)
    w = count(mb) / total
    return loss * w, (metrics, w)

  grad_fn = jax.value_and_grad(weighted, has_aux=True)
  m_shape = jax.eval_shape(lambda: loss_fn(params, jax.tree.map(lambda x: x[0], micro))[1])
  m_init = {k: jnp.full(v.shape, -jnp.inf if "max" in k else 0.0, v.dtype)
            for k, v in m_shape.items()}

  def body(carry, mb):
    g_acc, l_acc, m_acc = carry
    (loss, (metrics, w)), grads = grad_fn(params, mb)
    g_acc = jax.tree.map(jnp.add, g_acc, grads)
    m_acc = {k: jnp.maximum(m_acc[k], v) if "max" in k else m_acc[k] + w * v
             for k, v in metrics.items()}
    return (g_acc, l_acc + loss, m_acc), None

  g0 = jax.tree.map(jnp.zeros_like, params)
  (grads, loss, metrics), _ = jax.lax.scan(body, (g0, jnp.zeros((), jnp.float32), m_init), micro)
  return (loss, metrics), grads


def make_sft_step(graphdef, tx):
  """Cross-entropy on demonstration tokens. batch: tokens int32 [B, T], loss_mask f32 [B, T]."""

  def loss_fn(params, batch):
    model = nnx.merge(graphdef, params)
    logits, _ = model(batch["tokens"], default_positions(batch["tokens"]))
    logp = token_logprobs(logits, batch["tokens"])
    mask = batch["loss_mask"]
    return -(logp * mask).sum() / jnp.maximum(mask.sum(), 1.0)

  @functools.partial(jax.jit, donate_argnums=0)
  def step(state: TrainState, batch):
    loss, grads = jax.value_and_grad(loss_fn)(state.params, batch)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    return (TrainState(params, opt_state, state.step + 1),
            {"sft_loss": loss, "grad_norm": _global_norm(grads)})

  return step


def token_logprobs_and_entropy(logits: jax.Array, tokens: jax.Array, temperature: float = 1.0):
  """Like ``token_logprobs`` and also the policy entropy of each position's distribution
  (nats), both float32 [B, T] aligned with ``tokens`` (0 at t = 0)."""
  logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32) / temperature, axis=-1)
  picked = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
  entropy = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
  return jnp.pad(picked, ((0, 0), (1, 0))), jnp.pad(entropy, ((0, 0), (1, 0)))


def _add_router_aux(loss_and_metrics, aux, name: str):
  """``(loss, metrics)`` plus an MoE model's router load-balancing term: ``aux`` as
  ``Transformer.hidden_with_aux`` returns it (None: unchanged) adds ``aux["weighted"]``
  (``router_aux_loss_coef * lb``) to the loss and logs ``lb`` as ``metrics[name]``."""
  loss, metrics = loss_and_metrics
  if aux is None:
    return loss, metrics
  return loss + aux["weighted"], dict(metrics, **{name: aux["load_balancing_loss"]})


STALENESS_BINS = 64  # staleness_hist: action tokens per staleness 0..63 (larger counted in 63)


def advantage_targets(critic_graphdef, critic_params, batch: Batch, *, estimator: str,
                      gamma: float, lam_policy, lam_alpha: float, lam_critic: float,
                      bootstrap_truncated: bool, grpo_eps: float, value_bounds: tuple = (),
                      center_advantages: bool = False, constrain=_no_constraint):
  """Values, advantages and returns for a batch (SAO §3.3; ``algo.ESTIMATORS[estimator]``).

  With a critic estimator: values from the current critic (``V(s_t)`` at token t, zero off
  action tokens -- or off the response span for naive GAE), advantages with the policy lambda
  (``lam_policy``: a float or "adaptive" = ``1 - 1/(lam_alpha * l)``, l = action tokens of the
  row, VAPO) and returns with ``lam_critic``, both from the same values (decoupled lambda).
  ``bootstrap_truncated``: truncated rows bootstrap from the critic's value of the state after
  their last token instead of 0. Critic-free estimators (GRPO, running mean) give per-row
  advantages broadcast onto the row's action tokens; values and returns are 0.

  Two remedies of the value-overshoot study (issue 16; ours, not the paper's, both off by
  default): ``value_bounds`` (lo, hi) clips the critic's values to the reward range before GAE
  (a value above the best reward cannot make every advantage negative); ``center_advantages``
  subtracts the batch mean of the advantages over action tokens.

  Returns dict(values, advantages, returns), float32 [B, T], no gradient.
  """
  est = algo.get_estimator(estimator)
  mask = batch.action_mask
  if not est.uses_critic:
    row = est.fn(batch.reward, batch.group_id, batch.baseline, grpo_eps)
    zeros = jnp.zeros(mask.shape, jnp.float32)
    return {"values": zeros, "advantages": algo.broadcast_to_tokens(row, mask), "returns": zeros}
  critic = nnx.merge(critic_graphdef, critic_params)
  raw = constrain(critic(batch.tokens, default_positions(batch.tokens)), "tokens")
  on = algo.response_span(mask) if est.values_on_span else mask
  if value_bounds:
    raw = jnp.clip(raw, value_bounds[0], value_bounds[1])
  values = jax.lax.stop_gradient(shift_values(raw) * on)
  bootstrap = None
  if bootstrap_truncated:
    last = jnp.take_along_axis(raw, batch.last_index[:, None], axis=-1)[:, 0]
    bootstrap = jax.lax.stop_gradient(jnp.where(batch.truncated, last, 0.0))
  if lam_policy == "adaptive":
    lam = algo.length_adaptive_lambda(mask.sum(-1), lam_alpha)
  else:
    lam = jnp.float32(lam_policy)
  rewards = batch.token_rewards()
  adv, _ = est.fn(rewards, values, mask, gamma, lam, bootstrap)
  if center_advantages:
    adv = jnp.where(mask, adv - jnp.where(mask, adv, 0.0).sum() / jnp.maximum(mask.sum(), 1), 0.0)
  _, returns = est.fn(rewards, values, mask, gamma, lam_critic, bootstrap)
  return {"values": values, "advantages": jax.lax.stop_gradient(adv),
          "returns": jax.lax.stop_gradient(returns)}


def critic_update(graphdef, tx, state: TrainState, batch: Batch, targets: dict, *,
                  value_clip_eps: float = 0.0, microbatches: int = 1,
                  constrain=_no_constraint):
  """One value-model update on fixed targets (``targets["returns"]``; ``targets["values"]``
  are the values the targets were built from, for clipping at ``value_clip_eps`` > 0).
  Returns (state, metrics: value_loss, value_mean, return_mean, value_clipped_fraction,
  critic_grad_norm; for an MoE critic with ``router_aux_loss_coef`` > 0 also
  critic_router_aux_loss, its load-balancing loss over action tokens, whose weighted term is in
  value_loss)."""

  def loss_fn(params, mb):
    critic = nnx.merge(graphdef, params)
    values, aux = critic.with_aux(mb["batch"].tokens, default_positions(mb["batch"].tokens),
                                  mb["batch"].action_mask)
    values = constrain(values, "tokens")
    return _add_router_aux(
        algo.value_loss(shift_values(values), mb["returns"], mb["batch"].action_mask,
                        old_values=mb["values"],
                        clip_eps=value_clip_eps if value_clip_eps > 0 else None),
        aux, "critic_router_aux_loss")

  data = {"batch": batch, "returns": targets["returns"], "values": targets["values"]}
  (loss, metrics), grads = _value_and_grad(loss_fn, state.params, data, microbatches)
  updates, opt_state = tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  metrics = dict(metrics, value_loss=loss, critic_grad_norm=_global_norm(grads))
  return TrainState(params, opt_state, state.step + 1), metrics


def policy_update(graphdef, tx, state: TrainState, batch: Batch, advantages: jax.Array,
                  ref_params=None, *, objective: str, objective_kwargs: dict,
                  temperature: float, microbatches: int = 1, minibatches: int = 1,
                  constrain=_no_constraint):
  """Policy updates on one batch with ``algo.OBJECTIVES[objective]`` (default DIS, SAO Eq. 1-3)
  against the engine's rollout log-probs. ``objective_kwargs``: the objective's knobs (eps band,
  dual_clip, tis_cap, icepop_*, aggregation, entropy_coef, kl_coef, ...); with ``ref_params``
  the reference policy's log-probs enter the KL term. The policy's log-probs use the
  temperature the engine sampled with, so on-policy ratios are 1.

  ``minibatches`` M: the batch's rows are split into M interleaved mini-batches and the policy
  takes M optimizer steps, one per mini-batch, in order (PPO, Schulman et al. 2017, Alg. 1 with
  one epoch; the paper's GRPO baseline). The old policy of the PPO family is then the policy at
  the start of the batch (its log-probs computed once, before the first update), so from the
  second mini-batch on the ratio to it moves and the clip acts. With M = 1 the old policy is
  ``stop_gradient(logprobs)`` (the same thing for one update, without the extra forward pass).
  ``microbatches`` accumulates gradients inside each (mini-)batch. An MoE policy with
  ``router_aux_loss_coef`` > 0 adds ``coef * load_balancing_loss`` over the action tokens to the
  loss and logs the unweighted loss as ``router_aux_loss``. Returns (state, metrics):
  the mean over mini-batches (maxima for "max" keys, minima for "min" keys), plus
  ``policy_loss`` and ``policy_grad_norm``. Raises ValueError when B is not a multiple of M
  (x microbatches)."""
  fn = algo.get_objective(objective)

  def logprobs_of(params, tokens, aux_mask=None):
    model = nnx.merge(graphdef, params)
    h, aux = model.hidden_with_aux(tokens, default_positions(tokens), aux_mask=aux_mask)
    logits = constrain(model.logits_from_hidden(h), "logits")
    return (*token_logprobs_and_entropy(logits, tokens, temperature), aux)

  def loss_fn(params, mb):
    b = mb["batch"]
    logp, entropy, aux = logprobs_of(params, b.tokens, b.action_mask)
    ref = None
    if ref_params is not None:
      ref = jax.lax.stop_gradient(logprobs_of(ref_params, b.tokens)[0])
    return _add_router_aux(
        fn(logp, b.rollout_logprobs, mb["advantages"], b.action_mask, entropy=entropy,
           ref_logprobs=ref, old_logprobs=mb.get("old_logprobs"), **objective_kwargs),
        aux, "router_aux_loss")

  def update(st, data):
    (loss, metrics), grads = _value_and_grad(loss_fn, st.params, data, microbatches)
    updates, opt_state = tx.update(grads, st.opt_state, st.params)
    params = optax.apply_updates(st.params, updates)
    metrics = dict(metrics, policy_loss=loss, policy_grad_norm=_global_norm(grads))
    return TrainState(params, opt_state, st.step + 1), metrics

  data = {"batch": batch, "advantages": advantages}
  if minibatches == 1:
    return update(state, data)
  data["old_logprobs"] = jax.lax.stop_gradient(logprobs_of(state.params, batch.tokens)[0])
  state, per_mini = jax.lax.scan(update, state, split_microbatches(data, minibatches))
  reduce = lambda k, v: v.max(0) if "max" in k else v.min(0) if "min" in k else v.mean(0)
  return state, {k: reduce(k, v) for k, v in per_mini.items()}


def batch_metrics(batch: Batch, targets: dict, policy_version: jax.Array) -> dict:
  """Scalar metrics of one batch, computed once inside jit: staleness (``policy_version`` minus
  the version that sampled each action token: mean, max, ``staleness_hist`` int32
  [STALENESS_BINS]), advantages (mean / std over action tokens), explained variance of the
  critic, value min / max over action tokens, action tokens, reward mean over real rows."""
  mask = batch.action_mask
  n = jnp.maximum(mask.sum(dtype=jnp.float32), 1.0)
  stale = jnp.where(mask, policy_version - batch.policy_version, 0)
  hist = jax.ops.segment_sum(mask.astype(jnp.int32).ravel(),
                             jnp.clip(stale, 0, STALENESS_BINS - 1).ravel(), STALENESS_BINS)
  adv = targets["advantages"]
  adv_mean = jnp.where(mask, adv, 0.0).sum() / n
  adv_var = jnp.where(mask, (adv - adv_mean) ** 2, 0.0).sum() / n
  values = targets["values"]
  real = batch.group_id >= 0
  return {
      "staleness_mean": stale.sum() / n, "staleness_max": stale.max().astype(jnp.float32),
      "staleness_hist": hist,
      "advantage_mean": adv_mean, "advantage_std": jnp.sqrt(adv_var),
      "explained_variance": algo.explained_variance(values, targets["returns"], mask),
      # NaN (null in metrics.jsonl) when the batch has no action token, never +-inf
      "value_min": jnp.where(mask.any(), jnp.where(mask, values, jnp.inf).min(), jnp.nan),
      "value_max": jnp.where(mask.any(), jnp.where(mask, values, -jnp.inf).max(), jnp.nan),
      "action_tokens": mask.sum(dtype=jnp.float32),
      "reward_mean": jnp.where(real, batch.reward, 0.0).sum() / jnp.maximum(real.sum(), 1),
  }
