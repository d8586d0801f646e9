"""Pure, jitted train steps: SFT warm-up, critic (value) step, policy (DIS) step, advantages.

Each ``make_*`` returns ``step(state, batch) -> (state, metrics)`` jitted with the state donated,
following the Flax NNX Gemma example: the model's ``graphdef`` is static and the params (a pure
dict) are merged inside the loss. Batches are dicts of ``[B, T]`` arrays aligned with ``tokens``:
index t of ``action_mask``, ``rollout_logprobs``, ``advantages``, ``returns`` refers to token t,
whose log-prob comes from the logits at position t-1 (token 0 is never an action).

Optional arguments (defaults keep the single-device behaviour): ``shardings`` (a
``sao_jax.train.sharding.StepShardings``) jits with explicit ``in_shardings`` / ``out_shardings``
on a mesh and adds activation sharding constraints; ``microbatches`` accumulates gradients over
that many micro-batches in a ``lax.scan`` and gives the same loss and gradients as one pass over
the whole batch (token means use the whole batch's action-token count).
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


def _jit_step(step, shardings):
  """jit with the state donated; with ``shardings``, explicit in/out shardings (pjit style)."""
  if shardings is None:
    return jax.jit(step, donate_argnums=0)
  return jax.jit(step, in_shardings=(shardings.state, shardings.batch),
                 out_shardings=(shardings.state, shardings.replicated), donate_argnums=0)


def split_microbatches(batch, microbatches: int):
  """[B, ...] arrays -> [M, B/M, ...]; micro-batch j holds rows j, j+M, j+2M, ...

  Interleaving (not contiguous blocks) keeps every micro-batch spread over all the devices that
  hold the batch's rows. Raises ValueError if B is not a multiple of M."""
  def split(x):
    b = x.shape[0]
    if b % microbatches:
      raise ValueError(f"batch of {b} rows does not split into microbatches={microbatches} "
                       "(planned from mesh.tokens_per_device); pad the batch with "
                       "sao_jax.train.distributed.pad_rows.")
    x = x.reshape((b // microbatches, microbatches) + x.shape[1:])
    return jnp.swapaxes(x, 0, 1)
  return jax.tree.map(split, batch)


def _value_and_grad(loss_fn, params, batch, microbatches: int = 1, shardings=None):
  """``value_and_grad(loss_fn, has_aux=True)(params, batch)``, optionally accumulated.

  ``loss_fn(params, batch) -> (loss, metrics)`` must return token means over the batch's action
  tokens (``sum / max(n, 1)``, n = action tokens). With ``microbatches`` M > 1 each micro-batch's
  loss and metrics are re-weighted by ``max(n_j, 1) / max(N, 1)`` (N = whole batch) and summed,
  which equals the whole-batch token mean exactly in real arithmetic; metrics whose name contains
  "max" are maxima over micro-batches instead."""
  if microbatches == 1:
    return jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
  count = lambda b: jnp.maximum(b["action_mask"].astype(bool).sum(dtype=jnp.float32), 1.0)
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
    if shardings is not None:
      mb = jax.lax.with_sharding_constraint(mb, shardings.batch)
    (loss, (metrics, w)), grads = grad_fn(params, mb)
    g_acc = jax.tree.map(jnp.add, g_acc, grads)
    if shardings is not None:
      g_acc = jax.lax.with_sharding_constraint(g_acc, shardings.params)
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


CRITIC_ESTIMATORS = ("skip_obs_gae", "naive_gae", "step_gae_mean", "step_gae_last")


def make_advantage_fn(critic_graphdef, *, gamma: float, lam_policy, lam_critic: float = 1.0,
                      lam_alpha: float = 1.5, estimator: str = "skip_obs_gae",
                      bootstrap_truncated: bool = False, shardings=None):
  """Values from the current critic, then advantages (policy lambda) and returns (critic lambda)
  from the same values (SAO §3.3, decoupled lambda after VAPO).

  ``lam_policy`` is a float or "adaptive" (``1 - 1/(lam_alpha * l)``, l = action tokens per row,
  VAPO). ``estimator``: "skip_obs_gae" (SAO default), "naive_gae" (GAE through observation
  tokens, the ablation), "step_gae_mean" / "step_gae_last" (one value per turn, paper appendix).
  ``bootstrap_truncated``: for rows with ``batch["truncated"]`` set, bootstrap from the critic's
  value of the state after the row's last token (``batch["last_index"]``) instead of 0.
  Returns a jitted ``fn(critic_params, batch) -> dict(values, advantages, returns)``; with
  ``shardings`` (``StepShardings``) params and batch come in, and the [B, T] outputs go out,
  sharded like the batch rows.
  """
  if estimator not in CRITIC_ESTIMATORS:
    raise ValueError(f"unknown critic advantage estimator {estimator!r}; use one of "
                     f"{CRITIC_ESTIMATORS} (train.advantage_estimator).")

  def gae(rewards, values, mask, lam, bootstrap):
    if estimator == "skip_obs_gae":
      return algo.skip_observation_gae(rewards, values, mask, gamma, lam, bootstrap)
    if estimator == "naive_gae":
      return algo.naive_token_gae(rewards, values, mask, gamma, lam, bootstrap)
    return algo.step_level_gae(rewards, values, mask, gamma, lam,
                               "mean" if estimator == "step_gae_mean" else "last", bootstrap)

  def fn(critic_params, batch):
    critic = nnx.merge(critic_graphdef, critic_params)
    raw = critic(batch["tokens"], default_positions(batch["tokens"]))
    if shardings is not None:
      raw = shardings.constrain(raw, shardings.values_spec)
    values = shift_values(raw)
    if estimator == "naive_gae":  # the naive estimator reads values on observation tokens too
      values = jax.lax.stop_gradient(values * algo.response_span(batch["action_mask"]))
    else:
      values = jax.lax.stop_gradient(values * batch["action_mask"])
    bootstrap = None
    if bootstrap_truncated:
      last = jnp.take_along_axis(raw, batch["last_index"][:, None], axis=-1)[:, 0]
      bootstrap = jax.lax.stop_gradient(jnp.where(batch["truncated"], last, 0.0))
    if lam_policy == "adaptive":
      lam = algo.length_adaptive_lambda(batch["action_mask"].sum(-1), lam_alpha)
    else:
      lam = jnp.float32(lam_policy)
    adv, _ = gae(batch["rewards"], values, batch["action_mask"], lam, bootstrap)
    _, returns = gae(batch["rewards"], values, batch["action_mask"], lam_critic, bootstrap)
    return {"values": values, "advantages": adv, "returns": returns}

  if shardings is None:
    return jax.jit(fn)
  return jax.jit(fn, in_shardings=(shardings.params, shardings.batch),
                 out_shardings=shardings.batch)


def make_critic_step(graphdef, tx, *, value_clip_eps=None, shardings=None, microbatches: int = 1):
  """One value-model update on fixed targets. batch: tokens, action_mask, returns, values
  (the values used to build the targets, for clipping and explained variance).

  ``shardings``: optional ``StepShardings`` (state and batch shardings on a mesh);
  ``microbatches``: gradient accumulation over that many interleaved micro-batches (B must be
  a multiple of it)."""

  def loss_fn(params, batch):
    critic = nnx.merge(graphdef, params)
    values = critic(batch["tokens"], default_positions(batch["tokens"]))
    if shardings is not None:
      values = shardings.constrain(values, shardings.values_spec)
    values = shift_values(values)
    return algo.value_loss(values, batch["returns"], batch["action_mask"],
                           old_values=batch["values"], clip_eps=value_clip_eps)

  def step(state: TrainState, batch):
    (loss, metrics), grads = _value_and_grad(loss_fn, state.params, batch, microbatches,
                                             shardings)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = dict(metrics, value_loss=loss, critic_grad_norm=_global_norm(grads))
    return TrainState(params, opt_state, state.step + 1), metrics

  return _jit_step(step, shardings)


def token_logprobs_and_entropy(logits: jax.Array, tokens: jax.Array, temperature: float = 1.0):
  """Like ``token_logprobs`` and also the policy entropy of each position's distribution
  (nats), both float32 [B, T] aligned with ``tokens`` (0 at t = 0)."""
  logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32) / temperature, axis=-1)
  picked = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
  entropy = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
  return jnp.pad(picked, ((0, 0), (1, 0))), jnp.pad(entropy, ((0, 0), (1, 0)))


def make_logprob_fn(graphdef, temperature: float = 1.0):
  """Jitted ``fn(params, batch) -> logprobs [B, T]`` (e.g. the reference policy for KL)."""

  @jax.jit
  def fn(params, batch):
    model = nnx.merge(graphdef, params)
    logits, _ = model(batch["tokens"], default_positions(batch["tokens"]))
    return jax.lax.stop_gradient(token_logprobs(logits, batch["tokens"], temperature))

  return fn


def make_policy_step(graphdef, tx, *, eps_low: float, eps_high: float, temperature: float = 1.0,
                     objective: str = "dis", objective_kwargs: dict | None = None,
                     shardings=None, microbatches: int = 1):
  """One policy update with ``algo.OBJECTIVES[objective]`` (default DIS, SAO Eq. 1-3).

  batch: tokens, action_mask, rollout_logprobs, advantages, optional ref_logprobs (KL term).
  ``eps_low`` / ``eps_high`` are passed to the band / clip objectives; ``objective_kwargs`` adds
  the objective's other keywords (dual_clip, tis_cap, icepop_*, aggregation, kl_coef, ...). The
  old policy of the PPO family is ``stop_gradient(logprobs)``: the batch gets one policy update,
  so that *is* the recomputed old policy. The policy's log-probs use the same temperature the
  engine sampled with, so on-policy ratios are 1.

  ``shardings``: optional ``StepShardings`` (state and batch shardings on a mesh, logits
  constrained to rows x vocab); ``microbatches``: gradient accumulation over that many
  interleaved micro-batches (B must be a multiple of it; exact for token-mean aggregation)."""
  if microbatches > 1 and (objective_kwargs or {}).get("aggregation", "token_mean") != "token_mean":
    raise ValueError("micro-batching (mesh.tokens_per_device) is exact only for "
                     "train.aggregation='token_mean'; use one micro-batch or token_mean.")
  fn = algo.get_objective(objective)
  kwargs = dict(objective_kwargs or {})
  if objective != "reinforce":
    kwargs.update(eps_low=eps_low, eps_high=eps_high)

  def loss_fn(params, batch):
    model = nnx.merge(graphdef, params)
    logits, _ = model(batch["tokens"], default_positions(batch["tokens"]))
    if shardings is not None:
      logits = shardings.constrain(logits, shardings.logits_spec)
    logp, entropy = token_logprobs_and_entropy(logits, batch["tokens"], temperature)
    return fn(logp, batch["rollout_logprobs"], batch["advantages"], batch["action_mask"],
              entropy=entropy, ref_logprobs=batch.get("ref_logprobs"), **kwargs)

  def step(state: TrainState, batch):
    (loss, metrics), grads = _value_and_grad(loss_fn, state.params, batch, microbatches,
                                             shardings)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = dict(metrics, policy_loss=loss, policy_grad_norm=_global_norm(grads))
    return TrainState(params, opt_state, state.step + 1), metrics

  return _jit_step(step, shardings)
