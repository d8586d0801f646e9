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
hints ("logits": one chunk's [B, c, V], or [B, T, V] on the unchunked path; "tokens": [B, T]
and [B, T, D] row-major arrays); the identity on one device.

Memory: the policy's log-probs and entropy come from the final hidden states through the LM
head in chunks, at action tokens only (``policy_logprobs``: no float32 ``[B, T, V]``); the
critic differentiates only its trainable leaves (``critic_update(frozen_patterns=...)``); the
targets and the first critic update share one critic forward (``targets_and_critic_update``).
"""

from __future__ import annotations

import functools
import re
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct

from sao_jax import algo
from sao_jax.models.transformer import activation_constraint, default_positions
from sao_jax.train import optim
from sao_jax.train.batch import Batch

LOGPROB_CHUNK = 512  # tokens per device per chunk of the LM head (train.logprob_chunk)


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


def _merge_microbatches(x):
  """Inverse of ``split_microbatches`` for one array: [M, B/M, ...] -> [B, ...]."""
  return jnp.swapaxes(x, 0, 1).reshape((-1,) + x.shape[2:])


def _value_and_grad(loss_fn, params, batch, microbatches: int = 1, row_aux: bool = False):
  """``value_and_grad(loss_fn, has_aux=True)(params, batch)``, optionally accumulated.

  ``batch`` is a pytree with the ``Batch`` under key "batch" (and per-token targets beside it);
  ``loss_fn(params, batch) -> (loss, metrics)`` must return token means over the batch's action
  tokens (``sum / max(n, 1)``, n = action tokens). With ``microbatches`` M > 1 each micro-batch's
  loss and metrics are re-weighted by ``max(n_j, 1) / max(N, 1)`` (N = whole batch) and summed,
  which equals the whole-batch token mean exactly in real arithmetic; metrics whose name contains
  "max" are maxima over micro-batches instead.

  ``row_aux``: ``loss_fn`` returns ``(loss, (metrics, rows))`` with ``rows`` a pytree of
  per-row arrays [b, ...] of its (micro-)batch; they come back as [B, ...] in the batch's row
  order: ``((loss, (metrics, rows)), grads)``."""
  if not row_aux:
    def with_rows(p, b):
      loss, metrics = loss_fn(p, b)
      return loss, (metrics, None)
    (loss, (metrics, _)), grads = _value_and_grad(with_rows, params, batch, microbatches, True)
    return (loss, metrics), grads
  if microbatches == 1:
    return jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
  count = lambda b: jnp.maximum(b["batch"].action_mask.sum(dtype=jnp.float32), 1.0)
  total = count(batch)
  micro = split_microbatches(batch, microbatches)

  def weighted(p, mb):
    loss, (metrics, rows) = loss_fn(p, mb)
    w = count(mb) / total
    return loss * w, (metrics, w, rows)

  grad_fn = jax.value_and_grad(weighted, has_aux=True)
  m_shape = jax.eval_shape(lambda: loss_fn(params, jax.tree.map(lambda x: x[0], micro))[1][0])
  m_init = {k: jnp.full(v.shape, -jnp.inf if "max" in k else 0.0, v.dtype)
            for k, v in m_shape.items()}

  def body(carry, mb):
    g_acc, l_acc, m_acc = carry
    (loss, (metrics, w, rows)), grads = grad_fn(params, mb)
    g_acc = jax.tree.map(jnp.add, g_acc, grads)
    m_acc = {k: jnp.maximum(m_acc[k], v) if "max" in k else m_acc[k] + w * v
             for k, v in metrics.items()}
    return (g_acc, l_acc + loss, m_acc), rows

  g0 = jax.tree.map(jnp.zeros_like, params)
  (grads, loss, metrics), rows = jax.lax.scan(
      body, (g0, jnp.zeros((), jnp.float32), m_init), micro)
  return (loss, (metrics, jax.tree.map(_merge_microbatches, rows))), grads


def make_sft_step(graphdef, tx, logprob_chunk: int = LOGPROB_CHUNK):
  """Cross-entropy on demonstration tokens. batch: tokens int32 [B, T], loss_mask f32 [B, T].

  The log-probs come from ``policy_logprobs`` (chunked LM head at the masked positions only;
  ``logprob_chunk`` tokens per chunk, 0 = the full ``[B, T, V]`` path)."""

  def loss_fn(params, batch):
    mask = batch["loss_mask"]
    logp, _ = policy_logprobs(graphdef, params, batch["tokens"], mask != 0,
                              chunk=chunk_positions(logprob_chunk, *batch["tokens"].shape))
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
  (nats), both float32 [B, T] aligned with ``tokens`` (0 at t = 0). The full-logits reference
  of ``policy_logprobs`` (what ``train.logprob_chunk = 0`` runs)."""
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


# ---- log-probs from hidden states, in chunks ---------------------------------------------------

ENTROPY_MODES = ("off", "metric", "grad")


def chunk_positions(chunk_tokens: int, rows: int, length: int, row_shards: int = 1) -> int:
  """Positions per row in one chunk of ``policy_logprobs`` so that a chunk holds about
  ``chunk_tokens`` tokens per device: ``chunk_tokens // (rows / row_shards)``, at least 1, at
  most ``length``. 0 (the full ``[B, T, V]`` path) when ``chunk_tokens`` is 0.

  rows: the (global) rows of the step's (micro-)batch; row_shards: how many ways the mesh splits
  them (``sharding.batch_shards``). Raises ValueError on a negative ``chunk_tokens``."""
  if chunk_tokens < 0:
    raise ValueError(f"train.logprob_chunk must be >= 0 (0 = no chunking), got {chunk_tokens}.")
  if chunk_tokens == 0:
    return 0
  per_device = max(1, rows // max(1, row_shards))
  return max(1, min(length, chunk_tokens // per_device))


def lm_head_of(graphdef, params, hidden_like):
  """(head_fn, head_leaves): the model's LM head (``Transformer.logits_from_hidden``) as a
  function of only the parameter leaves it reads, found by tracing it once, so any head (tied,
  untied, with a bias or a cast) is differentiated as the model defines it and the chunked
  backward accumulates gradients for those leaves alone. head_fn(leaves, h [..., D]) -> logits
  [..., V] as the model returns them (float32; the chunked path computes in float32, as
  ``token_logprobs`` does)."""
  leaves, treedef = jax.tree.flatten(params)
  shapes = [jax.ShapeDtypeStruct(jnp.shape(x), x.dtype) for x in leaves]
  h_spec = jax.ShapeDtypeStruct((1, 1, hidden_like.shape[-1]), hidden_like.dtype)

  def full(ls, h):
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, ls)).logits_from_hidden(h)

  jaxpr = jax.make_jaxpr(full)(shapes, h_spec).jaxpr
  read = {id(v) for e in jaxpr.eqns for v in e.invars} | {id(v) for v in jaxpr.outvars}
  used = [i for i, v in enumerate(jaxpr.invars[:len(leaves)]) if id(v) in read]

  def head_fn(head_leaves, h):
    ls = list(shapes)  # never-read leaves stay abstract
    for i, x in zip(used, head_leaves):
      ls[i] = x
    return full(ls, h)

  return head_fn, [leaves[i] for i in used]


def _chunked_head(head_fn, temperature: float, entropy: str, constrain):
  """f(head_leaves, hs [n, B, c, D], ts int [n, B, c], active bool [n]) -> (logp, entropy)
  float32 [n, B, c]: per chunk i, with ``z = head(hs[i]) / temperature`` in float32,
  ``logp = z[ts[i]] - logsumexp(z)`` and the entropy ``-sum(exp(l) * l)``, ``l = z -
  logsumexp(z)`` (0 with entropy "off"); chunks with ``active[i]`` False are skipped (zeros).

  A ``jax.custom_vjp``: the forward keeps nothing of a chunk but its output; the backward
  (``lax.scan`` over chunks) recomputes one chunk's logits through ``jax.vjp`` of the head,
  forms ``dz = g_logp (onehot - p) + g_entropy (-p (log p + H))`` in closed form (one
  elementwise pass over ``z``: no log-softmax, probabilities or one-hot of the chunk are
  stored) and pulls it back, accumulating the head's parameter gradients in float32 (at
  least) in the scan carry. Memory O(chunk x V) in both passes, no per-chunk copy of the head.
  The entropy output carries no gradient unless ``entropy == "grad"``."""
  with_entropy, ent_grad = entropy != "off", entropy == "grad"
  inv_t = 1.0 / temperature

  def logits(leaves, hc):
    return constrain(head_fn(leaves, hc).astype(jnp.float32), "logits")

  def stats(z, tc):
    """z: [.., V] float32 already / temperature -> (logp, entropy, lse), each [..]."""
    lse = jax.nn.logsumexp(z, axis=-1)
    # a masked sum, not a gather: exact, and local to each shard of a vocab-sharded chunk
    picked = jnp.sum(jnp.where(jnp.arange(z.shape[-1]) == tc[..., None], z, 0.0), axis=-1)
    lp = picked - lse
    if not with_entropy:
      return lp, jnp.zeros_like(lp), lse
    logp_all = z - lse[..., None]  # fused into the reduction, never stored
    ent = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
    return lp, ent, lse

  def forward(leaves, hs, ts, active):
    zeros = jnp.zeros(ts.shape[1:], jnp.float32)

    def body(_, x):
      hc, tc, a = x
      out = jax.lax.cond(a, lambda: stats(logits(leaves, hc) * inv_t, tc)[:2],
                         lambda: (zeros, zeros))
      return None, out

    return jax.lax.scan(body, None, (hs, ts, active))[1]

  @jax.custom_vjp
  def f(leaves, hs, ts, active):
    return forward(leaves, hs, ts, active)

  def f_fwd(leaves, hs, ts, active):
    return forward(leaves, hs, ts, active), (leaves, hs, ts, active)

  def f_bwd(res, g):
    leaves, hs, ts, active = res
    g_lp, g_ent = g
    acc0 = [jnp.zeros(x.shape, jnp.promote_types(x.dtype, jnp.float32)) for x in leaves]

    def body(acc, x):
      hc, tc, a, glp, gent = x

      def on(acc):
        z, pull = jax.vjp(logits, leaves, hc)
        z = z * inv_t
        _, ent, lse = stats(z, tc)
        logp_all = z - lse[..., None]
        p = jnp.exp(logp_all)
        onehot = jnp.arange(z.shape[-1]) == tc[..., None]
        dz = glp[..., None] * (onehot - p)
        if ent_grad:
          dz = dz - gent[..., None] * p * (logp_all + ent[..., None])
        d_leaves, dh = pull(dz * inv_t)
        return [s + d.astype(s.dtype) for s, d in zip(acc, d_leaves)], dh

      return jax.lax.cond(a, on, lambda acc: (acc, jnp.zeros_like(hc)), acc)

    acc, dhs = jax.lax.scan(body, acc0, (hs, ts, active, g_lp, g_ent))
    return [s.astype(x.dtype) for s, x in zip(acc, leaves)], dhs, None, None

  f.defvjp(f_fwd, f_bwd)
  return f


def hidden_logprobs(head_fn, head_leaves, hidden: jax.Array, tokens: jax.Array,
                    where: jax.Array, *, chunk: int, temperature: float = 1.0,
                    entropy: str = "off", constrain=_no_constraint):
  """Token log-probs (and entropies) from final hidden states, at the positions that need them.

  ``logp[b, t] = log softmax(head(hidden[b, t-1]) / temperature)[tokens[b, t]]`` and
  ``entropy[b, t]`` the entropy (nats) of that distribution, computed only where ``where[b, t]``
  (0 elsewhere, and at t = 0). Each row's needed positions are moved to its front (a stable
  argsort), the hidden states of their predecessors gathered, and the LM head run on ``chunk``
  positions of every row at a time (``_chunked_head``); chunks past every row's last needed
  position are skipped. No float32 array larger than ``[B, chunk, V]`` is ever written.

  head_fn / head_leaves: from ``lm_head_of``; hidden: [B, T, D] (compute dtype); tokens: int
  [B, T]; where: bool [B, T]; chunk: positions per row per chunk (``chunk_positions``) >= 1;
  entropy: "off" (returns None), "metric" (computed, no gradient) or "grad" (differentiated).
  Returns (logp float32 [B, T], entropy float32 [B, T] or None). Raises ValueError on a bad
  ``entropy`` or ``chunk``."""
  if entropy not in ENTROPY_MODES:
    raise ValueError(f"entropy must be one of {ENTROPY_MODES}, got {entropy!r}.")
  if chunk < 1:
    raise ValueError(f"chunk must be >= 1 position per row, got {chunk}.")
  b, t = tokens.shape
  where = jnp.asarray(where, bool).at[:, 0].set(False)
  order = jnp.argsort(~where, axis=-1, stable=True)  # needed positions first, in order
  src = jnp.maximum(order - 1, 0)  # token t is scored by the hidden state at t - 1
  hs = constrain(jnp.take_along_axis(hidden, src[..., None], axis=1), "tokens")
  ts = jnp.take_along_axis(tokens, order, axis=1)
  ws = jnp.take_along_axis(where, order, axis=1)
  n = -(-t // chunk)
  pad = n * chunk - t
  if pad:
    hs = jnp.pad(hs, ((0, 0), (0, pad), (0, 0)))
    ts, ws = jnp.pad(ts, ((0, 0), (0, pad))), jnp.pad(ws, ((0, 0), (0, pad)))
  hs = jnp.moveaxis(hs.reshape(b, n, chunk, -1), 1, 0)
  ts = jnp.moveaxis(ts.reshape(b, n, chunk), 1, 0)
  active = ws.reshape(b, n, chunk).any(axis=(0, 2))
  f = _chunked_head(head_fn, temperature, entropy, constrain)
  lp, ent = f(head_leaves, hs, ts, active)
  inv = jnp.argsort(order, axis=-1)

  def unsort(x):  # [n, B, c] -> [B, T] in the original order, 0 where not needed
    x = jnp.moveaxis(x, 0, 1).reshape(b, n * chunk)[:, :t]
    return jnp.where(where, jnp.take_along_axis(x, inv, axis=1), 0.0)

  logp = unsort(lp)
  if entropy == "off":
    return logp, None
  ent = unsort(ent)
  return logp, (ent if entropy == "grad" else jax.lax.stop_gradient(ent))


def policy_logprobs(graphdef, params, tokens: jax.Array, where: jax.Array, *, chunk: int,
                    temperature: float = 1.0, entropy: str = "off",
                    constrain=_no_constraint):
  """The policy's token log-probs (and entropies) of ``tokens`` [B, T] at ``where`` [B, T].

  ``chunk`` >= 1: ``Transformer.hidden`` then ``hidden_logprobs`` (chunks of ``chunk``
  positions per row, needed positions only). ``chunk`` = 0: the full path, logits [B, T, V] of
  every position and ``token_logprobs_and_entropy`` (then masked to ``where`` as well).
  Returns (logp float32 [B, T], entropy float32 [B, T] or None for ``entropy="off"``); both 0
  off ``where``."""
  return policy_logprobs_aux(graphdef, params, tokens, where, chunk=chunk,
                             temperature=temperature, entropy=entropy, constrain=constrain)[:2]


def policy_logprobs_aux(graphdef, params, tokens: jax.Array, where: jax.Array, *, chunk: int,
                        temperature: float = 1.0, entropy: str = "off",
                        constrain=_no_constraint):
  """``policy_logprobs`` plus the MoE router loss over the ``where`` tokens: (logp, entropy,
  aux), ``aux`` as ``Transformer.hidden_with_aux`` returns it (None for a dense model or
  ``router_aux_loss_coef`` 0)."""
  model = nnx.merge(graphdef, params)
  pos = default_positions(tokens)
  with activation_constraint(lambda x: constrain(x, "tokens")):
    hidden, aux = model.hidden_with_aux(tokens, pos, aux_mask=where)
  if chunk == 0:
    logits = model.logits_from_hidden(hidden)
    logp, ent = token_logprobs_and_entropy(constrain(logits, "logits"), tokens, temperature)
    where = where.astype(bool)
    logp = jnp.where(where, logp, 0.0)
    if entropy == "off":
      return logp, None, aux
    ent = jnp.where(where, ent, 0.0)
    return logp, (ent if entropy == "grad" else jax.lax.stop_gradient(ent)), aux
  head_fn, head_leaves = lm_head_of(graphdef, params, hidden)
  return (*hidden_logprobs(head_fn, head_leaves, hidden, tokens, where, chunk=chunk,
                           temperature=temperature, entropy=entropy, constrain=constrain), aux)


STALENESS_BINS = 64  # staleness_hist: action tokens per staleness 0..63 (larger counted in 63)


def critic_values(critic_graphdef, critic_params, tokens: jax.Array,
                  constrain=_no_constraint, aux_mask=None):
  """The critic's raw outputs float32 [B, T] (``values[:, t]``: the state ending at token t)
  and its MoE router loss over the ``aux_mask`` tokens (``Critic.with_aux``; None for a dense
  backbone or ``router_aux_loss_coef`` 0)."""
  critic = nnx.merge(critic_graphdef, critic_params)
  with activation_constraint(lambda x: constrain(x, "tokens")):
    values, aux = critic.with_aux(tokens, default_positions(tokens), aux_mask=aux_mask)
  return constrain(values, "tokens"), aux


def targets_from_values(raw: Optional[jax.Array], batch: Batch, *, estimator: str, gamma: float,
                        lam_policy, lam_alpha: float, lam_critic: float,
                        bootstrap_truncated: bool, grpo_eps: float, value_bounds: tuple = (),
                        center_advantages: bool = False, returns_only: bool = False) -> dict:
  """``advantage_targets`` from the critic's raw outputs ``raw`` [B, T] (``critic_values``;
  None for a critic-free estimator). Row-local except ``center_advantages`` (a batch mean), so
  a micro-batch's returns equal the whole batch's on its rows. ``returns_only``: skip the
  advantages (dict(values, returns)), which is what a critic update needs."""
  est = algo.get_estimator(estimator)
  mask = batch.action_mask
  if not est.uses_critic:
    row = est.fn(batch.reward, batch.group_id, batch.baseline, grpo_eps)
    zeros = jnp.zeros(mask.shape, jnp.float32)
    return {"values": zeros, "advantages": algo.broadcast_to_tokens(row, mask), "returns": zeros}
  raw = jax.lax.stop_gradient(raw)
  on = algo.response_span(mask) if est.values_on_span else mask
  if value_bounds:
    raw = jnp.clip(raw, value_bounds[0], value_bounds[1])
  values = shift_values(raw) * on
  bootstrap = None
  if bootstrap_truncated:
    last = jnp.take_along_axis(raw, batch.last_index[:, None], axis=-1)[:, 0]
    bootstrap = jnp.where(batch.truncated, last, 0.0)
  rewards = batch.token_rewards()
  _, returns = est.fn(rewards, values, mask, gamma, lam_critic, bootstrap)
  if returns_only:
    return {"values": values, "returns": jax.lax.stop_gradient(returns)}
  if lam_policy == "adaptive":
    lam = algo.length_adaptive_lambda(mask.sum(-1), lam_alpha)
  else:
    lam = jnp.float32(lam_policy)
  adv, _ = est.fn(rewards, values, mask, gamma, lam, bootstrap)
  if center_advantages:
    adv = jnp.where(mask, adv - jnp.where(mask, adv, 0.0).sum() / jnp.maximum(mask.sum(), 1), 0.0)
  return {"values": values, "advantages": jax.lax.stop_gradient(adv),
          "returns": jax.lax.stop_gradient(returns)}


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

  The learner builds these inside the first critic update instead
  (``targets_and_critic_update``: one critic forward for both). Returns dict(values,
  advantages, returns), float32 [B, T], no gradient.
  """
  raw = None
  if algo.get_estimator(estimator).uses_critic:
    raw, _ = critic_values(critic_graphdef, critic_params, batch.tokens, constrain)
  return targets_from_values(raw, batch, estimator=estimator, gamma=gamma, lam_policy=lam_policy,
                             lam_alpha=lam_alpha, lam_critic=lam_critic,
                             bootstrap_truncated=bootstrap_truncated, grpo_eps=grpo_eps,
                             value_bounds=value_bounds, center_advantages=center_advantages)


def _trainable_split(params, frozen_patterns: Sequence[str]):
  """(trainable leaves, rebuild, full_grads) for differentiating only the trainable leaves.

  The leaves that ``optim.freeze_labels(params, frozen_patterns)`` labels "frozen" are closed
  over under ``stop_gradient``, so XLA never computes their gradients; ``rebuild(trainable)``
  gives the whole params tree, ``full_grads(g)`` the gradient tree the optimizer expects (zeros
  on frozen leaves, which its ``set_to_zero`` branch ignores). No patterns: every leaf trains."""
  leaves, treedef = jax.tree.flatten(params)
  if not frozen_patterns:
    return leaves, lambda tr: jax.tree.unflatten(treedef, tr), \
        lambda g: jax.tree.unflatten(treedef, g)
  labels = jax.tree.leaves(optim.freeze_labels(params, frozen_patterns))
  train = [i for i, lab in enumerate(labels) if lab == "trainable"]
  frozen = {i: jax.lax.stop_gradient(leaves[i]) for i, lab in enumerate(labels)
            if lab != "trainable"}

  def fill(tr, other):
    it = iter(tr)
    return jax.tree.unflatten(treedef, [other(i) if i in frozen else next(it)
                                        for i in range(len(leaves))])

  return ([leaves[i] for i in train], lambda tr: fill(tr, frozen.__getitem__),
          lambda g: fill(g, lambda i: jnp.zeros_like(leaves[i])))


ATTENTION_PATTERN = r"/attn/"  # the critic's attention leaves (roles.Train.critic_frozen_patterns)


def _attention_split_norms(grads) -> dict:
  """``critic_grad_norm_attn`` / ``critic_grad_norm_rest``: the global norms of the critic's
  gradient over its attention leaves (paths matching ``ATTENTION_PATTERN``; 0 when they are
  frozen) and over every other leaf, in one critic update: where an unfrozen critic's gradient
  goes, the quantity behind freezing its attention."""
  parts = {True: [], False: []}
  for p, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
    parts[bool(re.search(ATTENTION_PATTERN, optim.param_path(p)))].append(g)
  return {"critic_grad_norm_attn": _global_norm(parts[True]),
          "critic_grad_norm_rest": _global_norm(parts[False])}


def _critic_loss(graphdef, *, value_clip_eps: float, constrain, build_targets=None):
  """loss_fn(params, mb) -> (loss, (metrics, raw values [b, T])) of one critic update.

  Targets: ``mb["returns"]`` / ``mb["values"]`` (fixed), or with ``build_targets`` built from
  this forward's own (stop-gradient) values (``targets_from_values``, returns only)."""

  def loss_fn(params, mb):
    b = mb["batch"]
    raw, aux = critic_values(graphdef, params, b.tokens, constrain, aux_mask=b.action_mask)
    if build_targets is None:
      returns, old = mb["returns"], mb["values"]
    else:
      t = build_targets(raw, b)
      returns, old = t["returns"], t["values"]
    loss, metrics = _add_router_aux(
        algo.value_loss(shift_values(raw), returns, b.action_mask, old_values=old,
                        clip_eps=value_clip_eps if value_clip_eps > 0 else None),
        aux, "critic_router_aux_loss")
    return loss, (metrics, jax.lax.stop_gradient(raw))

  return loss_fn


def _critic_apply(tx, state: TrainState, loss_fn, data, microbatches: int, frozen_patterns):
  train, rebuild, full_grads = _trainable_split(state.params, frozen_patterns)
  (loss, (metrics, raw)), grads = _value_and_grad(
      lambda tr, mb: loss_fn(rebuild(tr), mb), train, data, microbatches, row_aux=True)
  # the norm of what is trained (clipping sees the same leaves); frozen leaves have none
  metrics = dict(metrics, value_loss=loss, critic_grad_norm=_global_norm(grads))
  grads = full_grads(grads)
  metrics.update(_attention_split_norms(grads))
  updates, opt_state = tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  return TrainState(params, opt_state, state.step + 1), metrics, raw


def critic_update(graphdef, tx, state: TrainState, batch: Batch, targets: dict, *,
                  value_clip_eps: float = 0.0, microbatches: int = 1,
                  constrain=_no_constraint, frozen_patterns: Sequence[str] = ()):
  """One value-model update on fixed targets (``targets["returns"]``; ``targets["values"]``
  are the values the targets were built from, for clipping at ``value_clip_eps`` > 0).

  ``frozen_patterns``: the optimizer's frozen leaves (``optim.freeze_labels``, the critic's
  attention), left out of the differentiated set; pass the patterns ``tx`` was built with (the
  update is the same without them, only slower). Returns (state, metrics: value_loss,
  value_mean, return_mean, value_clipped_fraction, critic_grad_norm over the trainable
  leaves; for an MoE critic with ``router_aux_loss_coef`` > 0 also critic_router_aux_loss, its
  load-balancing loss over action tokens, whose weighted term is in value_loss)."""
  loss_fn = _critic_loss(graphdef, value_clip_eps=value_clip_eps, constrain=constrain)
  data = {"batch": batch, "returns": targets["returns"], "values": targets["values"]}
  state, metrics, _ = _critic_apply(tx, state, loss_fn, data, microbatches, frozen_patterns)
  return state, metrics


def targets_and_critic_update(graphdef, tx, state: TrainState, batch: Batch, *,
                              target_kwargs: dict, value_clip_eps: float = 0.0,
                              microbatches: int = 1, constrain=_no_constraint,
                              frozen_patterns: Sequence[str] = ()):
  """``advantage_targets`` and the first ``critic_update`` on them from one critic forward.

  The targets come from the critic before its update, and the first update's forward runs
  the same params on the same tokens, so its values are the targets' values: each
  (micro-)batch's forward gives its rows' raw values, the returns the loss regresses on are
  built from them under ``stop_gradient`` (``targets_from_values``, row-local), and the raw
  values of all rows then give the batch's targets (advantages with ``center_advantages``
  need the whole batch). Equal to ``advantage_targets`` + ``critic_update`` up to the
  summation order of a micro-batched forward.

  target_kwargs: ``advantage_targets``' keywords (estimator, gamma, lam_policy, lam_alpha,
  lam_critic, bootstrap_truncated, grpo_eps, value_bounds, center_advantages); the estimator
  must use the critic. Returns (state, metrics as ``critic_update``, targets as
  ``advantage_targets``)."""
  if not algo.get_estimator(target_kwargs["estimator"]).uses_critic:
    raise ValueError(f"estimator {target_kwargs['estimator']!r} uses no critic; call "
                     "advantage_targets instead.")
  build = functools.partial(targets_from_values, **target_kwargs, returns_only=True)
  loss_fn = _critic_loss(graphdef, value_clip_eps=value_clip_eps, constrain=constrain,
                         build_targets=build)
  state, metrics, raw = _critic_apply(tx, state, loss_fn, {"batch": batch}, microbatches,
                                      frozen_patterns)
  return state, metrics, targets_from_values(raw, batch, **target_kwargs)


def policy_update(graphdef, tx, state: TrainState, batch: Batch, advantages: jax.Array,
                  ref_params=None, *, objective: str, objective_kwargs: dict,
                  temperature: float, microbatches: int = 1, minibatches: int = 1,
                  constrain=_no_constraint, logprob_chunk: int = LOGPROB_CHUNK,
                  row_shards: int = 1):
  """Policy updates on one batch with ``algo.OBJECTIVES[objective]`` (default DIS, SAO Eq. 1-3)
  against the engine's rollout log-probs. ``objective_kwargs``: the objective's knobs (eps band,
  dual_clip, tis_cap, icepop_*, aggregation, entropy_coef, kl_coef, ...); with ``ref_params``
  the reference policy's log-probs enter the KL term. The policy's log-probs use the
  temperature the engine sampled with, so on-policy ratios are 1.

  Log-probs (and the entropy) are computed at action tokens only, from the hidden states, by
  the LM head in chunks of ``logprob_chunk`` tokens per device (``policy_logprobs``; the batch's
  rows split ``row_shards`` ways on the mesh); 0 = the full ``[B, T, V]`` logits. The entropy
  is differentiated only when ``entropy_coef`` is non-zero; otherwise it is the ``entropy``
  metric alone. The reference and old policies' log-probs carry no entropy.

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
  entropy = "grad" if objective_kwargs.get("entropy_coef") else "metric"

  def logprobs_of(params, b, entropy_mode):
    chunk = chunk_positions(logprob_chunk, *b.tokens.shape, row_shards)
    return policy_logprobs_aux(graphdef, params, b.tokens, b.action_mask != 0, chunk=chunk,
                               temperature=temperature, entropy=entropy_mode,
                               constrain=constrain)

  def loss_fn(params, mb):
    b = mb["batch"]
    logp, ent, aux = logprobs_of(params, b, entropy)
    ref = None
    if ref_params is not None:
      ref = jax.lax.stop_gradient(logprobs_of(ref_params, b, "off")[0])
    return _add_router_aux(
        fn(logp, b.rollout_logprobs, mb["advantages"], b.action_mask, entropy=ent,
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
  data["old_logprobs"] = jax.lax.stop_gradient(logprobs_of(state.params, batch, "off")[0])
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
