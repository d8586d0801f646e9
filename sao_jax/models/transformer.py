"""Qwen3 dense / Qwen3-MoE / Llama decoder-only transformers and the critic in Flax NNX.

Architecture (Qwen3, https://huggingface.co/docs/transformers/model_doc/qwen3; Qwen3-MoE,
https://huggingface.co/docs/transformers/model_doc/qwen3_moe): RMSNorm pre-norm blocks; rotary
position embeddings (rotate-half layout, as Hugging Face) with the checkpoint's theta and optional
scaling (``linear``, ``llama3``, ``yarn``); grouped-query attention with RMSNorm on q and k per
head (off for the Llama layout), optional q/k/v biases; SwiGLU MLP, or a mixture of SwiGLU experts
with top-k softmax routing (optionally renormalised over the top k, ``norm_topk_prob``) on the
layers listed in ``ModelConfig.moe_layers``, only the routed experts computed (``moe_routed``;
``ModelConfig.moe_impl="dense"`` computes all, the reference); tied or untied input/output
embeddings.

Both modules take explicit ``positions`` so the same code serves training (full sequences,
causal mask), prefill (a chunk appended after an existing KV cache) and decoding (one token per
row, every row at its own position). The KV cache is a plain pytree:
``[(k, v) for each layer]`` with ``k: [batch, n_kv_heads, head_dim, cache_len]`` (keys stored
transposed, positions last) and ``v: [batch, n_kv_heads, cache_len, head_dim]``. Both
contractions batch over (batch, head), the leading axes, with no transpose of the cache, and both
are plain row-major products per (row, kv head): q.k is [G, D] x ``k [D, S]`` and p.v is [G, S] x
``v [S, D]``. With keys as ``[S, D]``, q.k was a head_dim-wide dot per position: decode
attention 1.4-2.2x slower at batch 8-128 on XLA:CPU (``benchmarks/RESULTS.md`` section 2). One
decode step writes one position of every row in place, see ``write_cache``. A cached call can
attend over only the first ``kv_len`` cache positions (the live length, bucketed by the caller)
instead of the whole cache.

Parameter paths (pure dicts from ``nnx.to_pure_dict``)::

  embed/embedding                         [vocab, d_model]
  layers/{i}/attn_norm/scale              [d_model]
  layers/{i}/attn/{q,k,v,o}_proj/kernel   [in, out]  (+ bias when attention_bias)
  layers/{i}/attn/{q,k}_norm/scale        [head_dim] (qk_norm)
  layers/{i}/mlp_norm/scale               [d_model]
  layers/{i}/mlp/{gate,up,down}_proj/kernel           dense layer
  layers/{i}/mlp/router/kernel            [d_model, n_experts]        MoE layer
  layers/{i}/mlp/{gate,up}_proj           [n_experts, d_model, moe_d_ff]
  layers/{i}/mlp/down_proj                [n_experts, moe_d_ff, d_model]
  final_norm/scale, lm_head/kernel (untied only)

Every attention parameter lives under ``.../attn/...`` so optimizers can freeze them by pattern
(see ``sao_jax.train.optim``); ``sao_jax.models.partition`` gives each path its logical axes.
The layout is the same whatever ``ModelConfig.remat`` and ``ModelConfig.scan_layers`` (a scan
stacks the per-layer parameters inside the forward only; see ``Transformer``).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Callable, Iterator, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sao_jax.models.config import ModelConfig, rope_frequencies

KVCache = list  # list[tuple[jax.Array, jax.Array]], one (k, v) per layer

_ACTIVATION_CONSTRAINT: contextvars.ContextVar = contextvars.ContextVar(
    "sao_jax_activation_constraint", default=None)


@contextlib.contextmanager
def activation_constraint(constrain: Callable[[jax.Array], jax.Array]) -> Iterator[None]:
  """Within this context (while a forward is traced), the models pass their residual stream
  ``x [B, T, D]`` through ``constrain`` after the embedding lookup and after every block.

  The train steps give ``x -> jax.lax.with_sharding_constraint(x, P(batch_axes))`` so that the
  activations are sharded on the batch's mesh axes. Without it, XLA's propagation lays the
  activations out like the embedding table (sharded on ``d_model`` under FSDP), and every chip
  runs every layer on the whole batch: per-chip activation memory then grows with the slice
  instead of shrinking (MaxText constrains each layer's activations with logical axis rules for
  the same reason). Read at trace time only; nothing is stored in the modules."""
  token = _ACTIVATION_CONSTRAINT.set(constrain)
  try:
    yield
  finally:
    _ACTIVATION_CONSTRAINT.reset(token)


def _constrain_activation(x: jax.Array) -> jax.Array:
  fn = _ACTIVATION_CONSTRAINT.get()
  return x if fn is None else fn(x)


def _acc_dtype(x: jax.Array):
  """Accumulation dtype for norms, RoPE and softmax: float32, or float64 when x is float64."""
  return jnp.promote_types(x.dtype, jnp.float32)


class RMSNorm(nnx.Module):
  """y = x / sqrt(mean(x^2) + eps) * scale, computed in float32 (float64 for float64 x),
  returned in x's dtype."""

  def __init__(self, dim: int, eps: float, param_dtype=jnp.float32):
    self.scale = nnx.Param(jnp.ones((dim,), param_dtype))
    self.eps = eps

  def __call__(self, x):
    acc = _acc_dtype(x)
    xa = x.astype(acc)
    y = xa * jax.lax.rsqrt(jnp.mean(xa * xa, axis=-1, keepdims=True) + self.eps)
    return (y * self.scale[...].astype(acc)).astype(x.dtype)


def rope(x: jax.Array, positions: jax.Array, theta=None, *, inv_freq=None,
         scale: float = 1.0) -> jax.Array:
  """Rotary embedding, rotate-half layout. x: [B, T, H, D]; positions: [B, T] int.

  Either ``theta`` (default frequencies) or ``inv_freq`` [D/2] (see ``rope_frequencies``).
  Angles, cos/sin and the rotation are float32, or float64 for float64 x."""
  d = x.shape[-1]
  acc = _acc_dtype(x)
  if inv_freq is None:
    inv_freq = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=acc) / d))
  angles = positions.astype(acc)[..., None] * jnp.asarray(inv_freq, acc)
  cos = (jnp.cos(angles) * scale)[:, :, None, :]
  sin = (jnp.sin(angles) * scale)[:, :, None, :]
  xa = x.astype(acc)
  x1, x2 = xa[..., : d // 2], xa[..., d // 2:]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


def _linear(rngs, din, dout, cfg: ModelConfig, bias: bool = False):
  return nnx.Linear(din, dout, use_bias=bias, rngs=rngs, dtype=cfg.compute_dtype,
                    param_dtype=cfg.params_dtype,
                    kernel_init=nnx.initializers.normal(stddev=din ** -0.5))


def query_block_size(t: int, min_block: int = 64, max_blocks: int = 8) -> int:
  """Query block length of the no-cache (training) attention: ``min_block`` rows, or more so
  that a sequence of ``t`` tokens splits into at most ``max_blocks`` blocks (each block is
  unrolled in the jitted graph)."""
  return max(min_block, -(-t // max_blocks))


def _attend(q, keys, values, mask):
  """Masked softmax attention of one query block.

  q [B, T, K, G, D] (G query heads share each of the K key/value heads); keys, values
  [B, S, K, D]; mask bool [B, T, S] (True = attend). Returns [B, T, K, G, D] in q's dtype.
  Scores and softmax are float32 (float64 for float64 q). Scores are laid out [B, K, T, G, S],
  the natural output order of the q.k contraction, so neither the scores nor their gradients
  are transposed (XLA:CPU would copy the [.., T, S] tensors otherwise)."""
  acc = _acc_dtype(q)
  scores = jnp.einsum("btkgd,bskd->bktgs", q, keys.astype(q.dtype)).astype(acc)
  scores = scores * (q.shape[-1] ** -0.5)
  scores = jnp.where(mask[:, None, :, None, :], scores, jnp.finfo(acc).min)
  probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
  return jnp.einsum("bktgs,bskd->btkgd", probs, values.astype(q.dtype))


def _attend_cached(q, keys, values, mask):
  """``_attend`` over a KV cache in its layout: q [B, T, K, G, D]; keys [B, K, D, S] (stored
  transposed), values [B, K, S, D] (the first S cache positions); mask bool [B, T, S]. Returns
  [B, T, K, G, D] in q's dtype.

  Both contractions batch over (b, k), the leading axes of the cache, so XLA reads the cache in
  place (with the [B, S, K, D] layout it copied the whole cache into this order every step).
  One query per row (T == 1, a decode step): per (b, k) a [G, D] x [D, S] and a [G, S] x [S, D]
  product, each over its operand's contiguous last axis (see the module docstring)."""
  acc = _acc_dtype(q)
  if q.shape[1] == 1:
    scores = jnp.einsum("bkgd,bkds->bkgs", q[:, 0], keys.astype(q.dtype)).astype(acc)
    scores = scores * (q.shape[-1] ** -0.5)  # [B, K, G, S]
    scores = jnp.where(mask[:, 0][:, None, None, :], scores, jnp.finfo(acc).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    return jnp.einsum("bkgs,bksd->bkgd", probs, values.astype(q.dtype))[:, None]
  scores = jnp.einsum("btkgd,bkds->bktgs", q, keys.astype(q.dtype)).astype(acc)
  scores = scores * (q.shape[-1] ** -0.5)
  scores = jnp.where(mask[:, None, :, None, :], scores, jnp.finfo(acc).min)
  probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
  return jnp.einsum("bktgs,bksd->btkgd", probs, values.astype(q.dtype))


def write_cache(c: jax.Array, u: jax.Array, start: jax.Array, *, keys: bool = False,
                rows: Optional[jax.Array] = None) -> jax.Array:
  """Writes chunk ``u[b]`` into cache row ``rows[b]`` (default b) at cache positions
  ``start[b] .. start[b] + T - 1``; positions >= S (the padded tail of a prefill chunk near the
  end) and rows >= the cache's batch (padding rows) are dropped.

  c: one layer's values [N, K, S, D], or with ``keys=True`` its keys [N, K, D, S]; u: [B, T, K,
  D] (the projection's layout); start: int32 [B]; rows: int32 [B] distinct, or None (B == N).
  Returns the updated cache. One scatter of the
  B * T new entries: under jit with the cache donated (the engine's decode state) it updates the
  cache in place, with no copy of the cache per step (the former vmapped
  ``dynamic_update_slice`` over [B, S, K, D] was lowered to copies: 24% of a batch-32 decode
  step)."""
  b, t = u.shape[:2]
  rows = (jnp.arange(b, dtype=jnp.int32) if rows is None else rows.astype(jnp.int32))[:, None]
  cols = start.astype(jnp.int32)[:, None] + jnp.arange(t, dtype=jnp.int32)[None]
  # [B, T] index arrays on two axes split by slices: the indexed shape is [B, T, K, D], u's
  at = c.at[rows, :, :, cols] if keys else c.at[rows, :, cols]
  return at.set(u.astype(c.dtype), unique_indices=True, mode="drop")


class Attention(nnx.Module):
  """Grouped-query attention with per-head q/k RMSNorm and a KV cache."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    self.q_proj = _linear(rngs, cfg.d_model, cfg.n_heads * cfg.head_dim, cfg, cfg.attention_bias)
    self.k_proj = _linear(rngs, cfg.d_model, cfg.n_kv_heads * cfg.head_dim, cfg,
                          cfg.attention_bias)
    self.v_proj = _linear(rngs, cfg.d_model, cfg.n_kv_heads * cfg.head_dim, cfg,
                          cfg.attention_bias)
    self.o_proj = _linear(rngs, cfg.n_heads * cfg.head_dim, cfg.d_model, cfg, cfg.o_bias)
    if cfg.qk_norm:
      self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_eps, cfg.params_dtype)
      self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_eps, cfg.params_dtype)

  def __call__(self, x, positions, cache: Optional[tuple] = None, key_mask=None,
               kv_len: Optional[int] = None, cache_rows: Optional[jax.Array] = None):
    cfg = self.cfg
    b, t, _ = x.shape
    q = self.q_proj(x).reshape(b, t, cfg.n_heads, cfg.head_dim)
    k = self.k_proj(x).reshape(b, t, cfg.n_kv_heads, cfg.head_dim)
    v = self.v_proj(x).reshape(b, t, cfg.n_kv_heads, cfg.head_dim)
    if cfg.qk_norm:
      q, k = self.q_norm(q), self.k_norm(k)
    inv_freq, rscale = rope_frequencies(cfg, np.float64 if x.dtype == jnp.float64 else np.float32)
    q = rope(q, positions, inv_freq=inv_freq, scale=rscale)
    k = rope(k, positions, inv_freq=inv_freq, scale=rscale)
    if cache is None:
      keys, values, key_pos = k, v, positions
      new_cache = None
    else:
      ck, cv = cache
      start = positions[:, 0]
      ck = write_cache(ck, k, start, keys=True, rows=cache_rows)
      cv = write_cache(cv, v, start, rows=cache_rows)
      new_cache = (ck, cv)
      s = cv.shape[2] if kv_len is None else min(int(kv_len), cv.shape[2])
      if cache_rows is None:  # the live length: positions >= s are empty
        keys, values = ck[..., :s], cv[:, :, :s]
      else:  # one gather of the rows' live part (padding rows >= N read a clipped row)
        keys = ck.at[cache_rows, :, :, :s].get(mode="clip")
        values = cv.at[cache_rows, :, :s].get(mode="clip")
      key_pos = jnp.broadcast_to(jnp.arange(s), (b, s))
    groups = cfg.n_heads // cfg.n_kv_heads
    q = q.reshape(b, t, cfg.n_kv_heads, groups, cfg.head_dim)
    mask = key_pos[:, None, :] <= positions[:, :, None]  # [B, T, S] causal on absolute positions
    if key_mask is not None:
      mask = mask & key_mask.astype(bool)[:, None, :]
    if cache is None:
      # No cache: also causal in sequence order (key index <= query index; the same mask when
      # positions increase along T, as they always do here). Query block [i, j) then never
      # sees keys >= j, so each block attends over keys [0, j) only: ~half the score work.
      mask = mask & jnp.tri(t, dtype=bool)[None]
      blk = query_block_size(t)
      out = jnp.concatenate(
          [_attend(q[:, i:i + blk], keys[:, :i + blk], values[:, :i + blk],
                   mask[:, i:i + blk, :i + blk]) for i in range(0, t, blk)], axis=1)
    else:
      out = _attend_cached(q, keys, values, mask)
    out = out.reshape(b, t, cfg.n_heads * cfg.head_dim)
    return self.o_proj(out), new_cache


class MLP(nnx.Module):
  """SwiGLU: down(silu(gate(x)) * up(x))."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    self.gate_proj = _linear(rngs, cfg.d_model, cfg.d_ff, cfg)
    self.up_proj = _linear(rngs, cfg.d_model, cfg.d_ff, cfg)
    self.down_proj = _linear(rngs, cfg.d_ff, cfg.d_model, cfg)

  STACK_MIN_TOKENS = 512  # below this (decode steps), stacking would copy the kernels per token

  def __call__(self, x):
    tokens = math.prod(x.shape[:-1])
    if tokens < self.STACK_MIN_TOKENS:  # decode: two plain dots, no per-step copy of the kernels
      return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x)), None
    # Training / prefill: gate and up in one contraction over the stacked kernels [2, D, F]: the
    # same products as two Linear calls, but one forward dot and one weight-gradient dot instead
    # of two each (XLA:CPU transposes the activations once, not twice: the tiny train step is
    # ~10% faster). The stack copies both kernels once per call, which a decode step with a few
    # tokens cannot amortise (the sampler benchmark's batch-1 decode was 2x slower with it).
    dt = self.cfg.compute_dtype
    w = jnp.stack([self.gate_proj.kernel[...], self.up_proj.kernel[...]]).astype(dt)
    gate_up = jnp.einsum("...d,sdf->...sf", x.astype(dt), w)
    h = jax.nn.silu(gate_up[..., 0, :]) * gate_up[..., 1, :]
    return self.down_proj(h), None


def route_top_k(router_logits: jax.Array, top_k: int,
                normalize: bool) -> tuple[jax.Array, jax.Array]:
  """Top-k softmax routing (Qwen3-MoE / Mixtral): ``(weights [..., k] float32, experts [..., k]
  int32)``, the k chosen experts of each token in decreasing probability.

  ``p = softmax(router_logits)`` in float32; the k largest ``p`` are kept, renormalised to sum to
  1 when ``normalize`` (the checkpoint's ``norm_topk_prob``)."""
  probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
  top_p, top_i = jax.lax.top_k(probs, top_k)
  if normalize:
    top_p = top_p / jnp.sum(top_p, axis=-1, keepdims=True)
  return top_p, top_i


def route(router_logits: jax.Array, top_k: int, normalize: bool) -> jax.Array:
  """``route_top_k`` as dense combine weights [..., E] float32 (0 for every expert not chosen)."""
  top_p, top_i = route_top_k(router_logits, top_k, normalize)
  onehot = jax.nn.one_hot(top_i, router_logits.shape[-1], dtype=jnp.float32)  # [..., k, E]
  return jnp.einsum("...k,...ke->...e", top_p, onehot)


def moe_dense(x, router_logits, gate, up, down, top_k: int, normalize: bool) -> jax.Array:
  """The mixture computed over every expert for every token (the reference for ``moe_routed``).

  x [..., D] (its dtype is the compute dtype); router_logits [..., E]; gate, up [E, D, F]; down
  [E, F, D], all in x's dtype. Returns [..., D] in x's dtype: ``sum_e w_e * down_e(silu(gate_e(x))
  * up_e(x))`` with ``w = route(router_logits)``. Cost ``n_experts / top_k`` times the routed
  FLOPs, and a [..., E, F] intermediate."""
  w = route(router_logits, top_k, normalize).astype(x.dtype)
  g = jnp.einsum("...d,edf->...ef", x, gate)
  u = jnp.einsum("...d,edf->...ef", x, up)
  return jnp.einsum("...ef,efd->...d", jax.nn.silu(g) * u * w[..., None], down)


def moe_routed(x, router_logits, gate, up, down, top_k: int, normalize: bool) -> jax.Array:
  """The mixture computed for the routed experts only (arguments and result as ``moe_dense``).

  Sort-based dispatch: the N * k (token, expert) pairs of the N tokens are sorted by expert id
  (``argsort``, stable), each pair's token row is gathered, and the three projections are grouped
  matmuls over the sorted rows (``jax.lax.ragged_dot`` with the per-expert row counts as group
  sizes); each row is scaled by its routing weight before ``down`` (as ``moe_dense`` does), the
  rows are put back in (token, k) order by the inverse permutation and summed over k in float32.
  No token is dropped (no expert capacity), so the result equals ``moe_dense`` up to float
  rounding, for any N (training batches, prefill chunks, one-token decode steps).

  How XLA compiles it (``benchmarks/moe_flops.py`` prints the FLOPs; numbers in
  ``benchmarks/RESULTS.md``): on TPU the forward and the input gradient are grouped matmuls
  (``chlo.ragged_dot``, ``2 * N * k * D * F`` FLOPs per projection), but the weight gradient (a
  ragged contracting dimension) is compiled as a masked dense product over all E groups, E times
  that; on CPU JAX lowers every ``ragged_dot`` to a masked dense product over all groups (the
  same numbers, ``k`` times ``moe_dense``'s FLOPs: ``ModelConfig.moe_impl="dense"`` is the cheaper
  choice there). With the experts sharded on a mesh axis, XLA's SPMD partitioner all-gathers the
  expert weights around each ``ragged_dot`` (correct, not expert-parallel); a grouped-matmul
  kernel with its own weight gradient (Pallas megablox ``gmm``/``tgmm``) needs a ``shard_map``
  over the expert axis, which this function does not do.
  """
  *lead, d = x.shape
  e = gate.shape[0]
  xf = x.reshape(-1, d)
  n = xf.shape[0]
  top_p, top_i = route_top_k(router_logits.reshape(n, e), top_k, normalize)
  flat = top_i.reshape(-1)  # [N * k]: pair i is token i // k's (i % k)-th choice
  order = jnp.argsort(flat, stable=True)  # pairs grouped by expert
  sizes = jnp.bincount(flat, length=e).astype(jnp.int32)  # rows per expert, sums to N * k
  xs = xf[order // top_k]  # [N * k, D]
  g = jax.lax.ragged_dot(xs, gate, sizes)
  u = jax.lax.ragged_dot(xs, up, sizes)
  h = jax.nn.silu(g) * u * top_p.reshape(-1)[order].astype(x.dtype)[:, None]
  y = jax.lax.ragged_dot(h, down, sizes, preferred_element_type=jnp.float32)  # [N * k, D]
  y = y[jnp.argsort(order)].reshape(n, top_k, d).sum(axis=1)
  return y.astype(x.dtype).reshape(*lead, d)


class MoE(nnx.Module):
  """Mixture of SwiGLU experts with a linear top-k router (Qwen3-MoE sparse block).

  ``__call__(x [B, T, D]) -> (y [B, T, D], router_logits [B, T, E] float32)`` with
  ``y = sum_e w_e(x) * down_e(silu(gate_e(x)) * up_e(x))`` and ``w = route(router(x))``.
  ``cfg.moe_impl`` picks the computation: "routed" (default, ``moe_routed``: only the k routed
  experts of each token run, as grouped matmuls) or "dense" (``moe_dense``: every expert for
  every token, the reference). The parameters are the same for both: experts stacked on a
  leading axis (logical axis "expert", ``sao_jax.models.partition``).
  """

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    e, d, f = cfg.n_experts, cfg.d_model, cfg.moe_d_ff
    pdt = cfg.params_dtype
    self.router = nnx.Linear(d, e, use_bias=False, rngs=rngs, dtype=jnp.float32, param_dtype=pdt,
                             kernel_init=nnx.initializers.normal(stddev=d ** -0.5))
    init = nnx.initializers.normal(stddev=d ** -0.5)
    self.gate_proj = nnx.Param(init(rngs.params(), (e, d, f), pdt))
    self.up_proj = nnx.Param(init(rngs.params(), (e, d, f), pdt))
    self.down_proj = nnx.Param(nnx.initializers.normal(stddev=f ** -0.5)(rngs.params(), (e, f, d),
                                                                         pdt))

  def __call__(self, x):
    cfg = self.cfg
    logits = self.router(x.astype(jnp.float32))
    fn = moe_dense if cfg.moe_impl == "dense" else moe_routed
    dt = x.dtype
    y = fn(x, logits, self.gate_proj[...].astype(dt), self.up_proj[...].astype(dt),
           self.down_proj[...].astype(dt), cfg.n_experts_per_tok, cfg.norm_topk_prob)
    return y, logits


class Block(nnx.Module):

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, layer: int = 0):
    self.attn_norm = RMSNorm(cfg.d_model, cfg.rms_eps, cfg.params_dtype)
    self.attn = Attention(cfg, rngs)
    self.mlp_norm = RMSNorm(cfg.d_model, cfg.rms_eps, cfg.params_dtype)
    self.mlp = MoE(cfg, rngs) if layer in cfg.moe_layers else MLP(cfg, rngs)

  def __call__(self, x, positions, cache=None, key_mask=None, kv_len=None, cache_rows=None):
    h, new_cache = self.attn(self.attn_norm(x), positions, cache, key_mask, kv_len, cache_rows)
    x = x + h
    m, router_logits = self.mlp(self.mlp_norm(x))
    return x + m, new_cache, router_logits


def remat_policy(name: str):
  """The ``jax.checkpoint`` policy of ``ModelConfig.remat`` ``name``: None for "block" (save
  nothing but the block's inputs: recompute everything), ``dots_with_no_batch_dims_saveable`` for
  "dots_saveable" (keep the outputs of matmuls without batch dimensions: the projections; recompute
  the batched attention contractions, softmax, norms, RoPE, activations). Raises ValueError for
  "none" or an unknown name."""
  if name == "block":
    return None
  if name == "dots_saveable":
    return jax.checkpoint_policies.dots_with_no_batch_dims_saveable
  raise ValueError(f"model.remat={name!r} has no checkpoint policy; use 'block' or "
                   "'dots_saveable' (or 'none': no jax.checkpoint at all).")


def block_fn(graphdef, remat: str = "none", prevent_cse: bool = True):
  """One block of a no-cache forward as a pure function
  ``f(state, x [B, T, D], positions [B, T], attention_mask [B, T] or None) -> (x, router)``
  (``router``: what the block's MLP returns besides its output -- MoE router logits [B, T, E]
  float32, None for a dense MLP), where ``graphdef, state = nnx.split(block)``.

  ``remat`` other than "none" wraps it in ``jax.checkpoint`` with ``remat_policy(remat)``;
  ``prevent_cse=False`` is for a body of ``jax.lax.scan``, where the loop already keeps XLA from
  merging the recomputation into the forward (JAX's ``jax.checkpoint`` documentation)."""
  def f(state, x, positions, attention_mask):
    x, _, router = nnx.merge(graphdef, state)(x, positions, None, attention_mask)
    return _constrain_activation(x), router
  if remat == "none":
    return f
  return jax.checkpoint(f, policy=remat_policy(remat), prevent_cse=prevent_cse)


def _signature(state) -> tuple:
  return jax.tree.structure(state), tuple((a.shape, a.dtype) for a in jax.tree.leaves(state))


def layer_runs(blocks: Sequence[nnx.Module]) -> list[tuple[int, int]]:
  """Maximal runs ``[start, end)`` of consecutive blocks with the same structure (graphdef) and
  the same parameter shapes and dtypes: one run for a dense or an all-MoE model, one per dense /
  MoE stretch when ``moe_layers`` is a strict subset of the layers. Each run can be one scan."""
  runs, prev = [], None
  for i, b in enumerate(blocks):
    graphdef, state = nnx.split(b)
    key = (graphdef, _signature(state))
    if runs and key == prev:
      runs[-1] = (runs[-1][0], i + 1)
    else:
      runs.append((i, i + 1))
    prev = key
  return runs


def _cast_for_compute(block: nnx.Module, state):
  """``state`` (of ``nnx.split(block)``) with the kernel and bias of every ``nnx.Linear`` that
  computes in a narrower dtype than it stores (a float32 master copy under bfloat16 compute) cast
  to that dtype now: the cast the layer makes first thing, so the results and gradients are the
  same, but a stack of the state holds the narrow copy. Norm scales, the MoE router (float32
  compute) and any parameter not owned by an ``nnx.Linear`` keep their dtype."""
  casts = {tuple(path): jnp.dtype(node.dtype) for path, node in nnx.iter_graph(block)
           if isinstance(node, nnx.Linear) and node.dtype is not None}

  def cast(path, leaf):
    keys = tuple(k.key for k in path if isinstance(k, jax.tree_util.DictKey))
    dt = casts.get(keys[:-1]) if keys and keys[-1] in ("kernel", "bias") else None
    if (dt is None or not jnp.issubdtype(leaf.dtype, jnp.floating)
        or dt.itemsize >= leaf.dtype.itemsize):
      return leaf
    return leaf.astype(dt)

  return jax.tree_util.tree_map_with_path(cast, state)


def stack_states(blocks: Sequence[nnx.Module]):
  """``(graphdef, stacked state)`` of homogeneous blocks: every parameter leaf gets a leading
  layer axis ``[L, ...]`` (``jnp.stack``), in the dtype the block computes with where that is
  exact (``_cast_for_compute``: the ``nnx.Linear`` kernels), else in the parameter's own."""
  graphdef = nnx.split(blocks[0])[0]
  states = [_cast_for_compute(b, nnx.split(b)[1]) for b in blocks]
  return graphdef, jax.tree.map(lambda *a: jnp.stack(a), *states)


class Transformer(nnx.Module):
  """Decoder-only LM. ``__call__`` returns ``(logits [B, T, V] float32, new_cache)``.

  Args (call):
    tokens: int32 [B, T].
    positions: int32 [B, T], absolute positions; with a cache, row b's chunk is written at
      ``positions[b, 0] ... positions[b, 0] + T - 1`` (contiguous).
    cache: None (no cache: causal attention among the T tokens, in sequence order and on
      positions, computed in query blocks) or a ``KVCache`` whose entries at positions
      < positions[b, 0] are valid for row b.
    attention_mask: optional {0,1} [B, T] (no-cache calls only): keys with 0 (padding) are never
      attended to. Right padding needs no mask (causality already hides it); left padding does.
    kv_len: optional static int (cache calls only): attend over cache positions < kv_len only;
      must exceed every position in ``positions`` (the caller's live-length bucket). None = the
      whole cache.
    cache_rows: optional int32 [B] (cache calls only): the cache rows the B input rows read and
      write, distinct, for a cache of any batch N (the engine's prefill of chunks straight into
      decode slots: only the chunk's new entries are written, in place under donation). Rows
      >= N are padding: their writes are dropped. None = row b uses cache row b (N == B).

  No-cache calls (training, scoring) follow ``cfg.remat`` and ``cfg.scan_layers``; cached calls
  (prefill, decode) always run the blocks unrolled without ``jax.checkpoint``. The results agree
  whatever the two fields (float32: to rounding, ``tests/unit/models/test_remat.py``).

  ``cfg.remat``: each block of the forward is one ``jax.checkpoint`` (``block_fn``). Unrolled,
  the saving depends on the compiler keeping the recomputation apart from the forward: the TPU
  compiler does; XLA:CPU lowers the optimisation barriers early and merges the recomputation
  back into the forward (little saved). Inside the backward loop of a scan it cannot, so with
  ``cfg.scan_layers`` the saving holds on every backend.

  ``cfg.scan_layers``: each run of identical blocks (``layer_runs``) is one ``jax.lax.scan``
  over a stacked copy of its blocks' parameters (``stack_states``), so the program holds one
  block body per run, not one per layer. The parameters themselves stay per layer; the cost is
  that copy -- one more copy of the layer weights in the traced program -- and in the backward a
  stacked weight gradient before it is split back per layer. XLA does not move a layer's
  compute-dtype cast ahead of the stack (a float32 master copy stacked as is stays float32 under
  bfloat16 compute), so the ``nnx.Linear`` kernels are cast before stacking (exact: the cast
  the layer makes anyway); the copy is then in the compute dtype. Without remat the loop also stores
  every iteration's residuals as stacked outputs, which XLA otherwise fuses away in part: scan
  with remat "block" or "dots_saveable", not alone. ``benchmarks/RESULTS.md`` has the measured
  temp bytes.
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, rngs=rngs, param_dtype=cfg.params_dtype,
                           embedding_init=nnx.initializers.normal(stddev=1.0))
    self.layers = nnx.List([Block(cfg, rngs, i) for i in range(cfg.n_layers)])
    self.final_norm = RMSNorm(cfg.d_model, cfg.rms_eps, cfg.params_dtype)
    if not cfg.tie_embeddings:
      self.lm_head = _linear(rngs, cfg.d_model, cfg.vocab_size, cfg)

  def _run(self, tokens, positions, cache, attention_mask, kv_len=None, cache_rows=None):
    if cache is not None and attention_mask is not None:
      raise ValueError("attention_mask is only supported without a KV cache.")
    x = _constrain_activation(self.embed(tokens).astype(self.cfg.compute_dtype))
    if cache is None and (self.cfg.remat != "none" or self.cfg.scan_layers):
      x, router_logits = self._run_blocks(x, positions, attention_mask)
      return self.final_norm(x), None, router_logits
    new_cache, router_logits = [], []
    for i, layer in enumerate(self.layers):
      x, c, r = layer(x, positions, None if cache is None else cache[i], attention_mask, kv_len,
                      cache_rows)
      x = _constrain_activation(x)
      new_cache.append(c)
      if r is not None:
        router_logits.append(r)
    return self.final_norm(x), (None if cache is None else new_cache), router_logits

  def _run_blocks(self, x, positions, attention_mask):
    """The blocks of a no-cache forward under ``cfg.remat`` / ``cfg.scan_layers``: returns
    ``(x [B, T, D], router_logits)`` with ``router_logits`` one entry per MoE layer in layer
    order (as the unrolled loop), unstacked from the scan's per-layer outputs."""
    cfg = self.cfg
    blocks = list(self.layers)
    router_logits = []
    if not cfg.scan_layers:
      for block in blocks:
        graphdef, state = nnx.split(block)
        x, r = block_fn(graphdef, cfg.remat)(state, x, positions, attention_mask)
        if r is not None:
          router_logits.append(r)
      return x, router_logits
    for start, end in layer_runs(blocks):
      if end - start == 1:  # a lone block (e.g. one dense layer among MoE ones): no loop
        graphdef, state = nnx.split(blocks[start])
        x, r = block_fn(graphdef, cfg.remat)(state, x, positions, attention_mask)
        router_logits.extend([] if r is None else [r])
        continue
      graphdef, stacked = stack_states(blocks[start:end])
      f = block_fn(graphdef, cfg.remat, prevent_cse=False)

      def body(h, state, f=f):
        return f(state, h, positions, attention_mask)

      x, rs = jax.lax.scan(body, x, stacked)
      if rs is not None:  # per-layer outputs stacked [L_run, ...]: one entry per layer again
        router_logits.extend(jax.tree.map(lambda a, j=j: a[j], rs) for j in range(end - start))
    return x, router_logits

  def hidden(self, tokens, positions, cache: Optional[KVCache] = None, attention_mask=None,
             kv_len: Optional[int] = None, cache_rows: Optional[jax.Array] = None):
    """Final normed hidden states [B, T, D] (compute dtype) and the new cache (arguments as
    ``__call__``)."""
    h, new_cache, _ = self._run(tokens, positions, cache, attention_mask, kv_len, cache_rows)
    return h, new_cache

  def logits_from_hidden(self, h):
    """[B, T, D] -> float32 logits [B, T, V] (tied: ``h @ embedding.T``): operands in the
    compute dtype, products accumulated and returned in float32 (float64 for a float64
    model), never rounded to bf16."""
    acc, dt = _acc_dtype(h), self.cfg.compute_dtype
    w = (self.embed.embedding[...].T if self.cfg.tie_embeddings else self.lm_head.kernel[...])
    return jnp.matmul(h.astype(dt), w.astype(dt), preferred_element_type=acc)

  def __call__(self, tokens, positions, cache: Optional[KVCache] = None, *, attention_mask=None,
               kv_len: Optional[int] = None, cache_rows: Optional[jax.Array] = None):
    h, new_cache, _ = self._run(tokens, positions, cache, attention_mask, kv_len, cache_rows)
    return self.logits_from_hidden(h), new_cache

  def hidden_with_aux(self, tokens, positions, attention_mask=None, aux_mask=None):
    """No-cache ``hidden`` plus the router loss to add to a training loss: ``(h [B, T, D], aux)``.

    ``aux`` is None for a model without MoE layers or with ``router_aux_loss_coef`` 0; otherwise
    ``{"load_balancing_loss": lb, "weighted": router_aux_loss_coef * lb}`` (float32 scalars), lb
    from ``load_balancing_loss`` over the tokens where ``aux_mask`` {0,1} [B, T] is 1 (default:
    ``attention_mask``, else every token)."""
    h, _, rl = self._run(tokens, positions, None, attention_mask)
    if not rl or self.cfg.router_aux_loss_coef <= 0:
      return h, None
    mask = attention_mask if aux_mask is None else aux_mask
    lb = load_balancing_loss(rl, self.cfg.n_experts_per_tok, mask)
    return h, {"load_balancing_loss": lb, "weighted": self.cfg.router_aux_loss_coef * lb}


def load_balancing_loss(router_logits, top_k: int,
                        attention_mask: Optional[jax.Array] = None) -> jax.Array:
  """Switch-Transformer load-balancing loss as Hugging Face computes it for Qwen3-MoE / Mixtral
  (``load_balancing_loss_func``).

  ``E * sum_{k, e} f_{k,e} * P_e`` where, over all (layer, token) pairs that the mask keeps,
  ``f_{k,e}`` is the fraction whose k-th choice is expert e and ``P_e`` the mean router probability
  of e (Fedus et al. 2021, Eq. 4); the gradient flows through ``P`` only. router_logits:
  [L, B, T, E] or a sequence of L arrays [B, T, E] (summed layer by layer, never stacked);
  attention_mask: {0,1} [B, T] or None (every token). Returns a float32 scalar: ``top_k`` for
  perfectly uniform routing, up to ``top_k * E`` when every token picks the same experts; 0 when
  the mask keeps no token. Multiply by ``router_aux_loss_coef`` before adding to a loss.
  """
  f_sum = p_sum = n = 0.0
  for r in router_logits:  # one layer: [B, T, E]
    probs = jax.nn.softmax(r.astype(jnp.float32), axis=-1)
    _, sel = jax.lax.top_k(probs, top_k)
    onehot = jax.nn.one_hot(sel, r.shape[-1], dtype=jnp.float32)  # [B, T, k, E]
    w = (jnp.ones(r.shape[:-1], jnp.float32) if attention_mask is None
         else attention_mask.astype(jnp.float32))
    f_sum = f_sum + jnp.einsum("btke,bt->ke", onehot, w)
    p_sum = p_sum + jnp.einsum("bte,bt->e", probs, w)
    n = n + jnp.sum(w)
  n = jnp.maximum(n, 1.0)
  return jnp.sum((f_sum / n) * (p_sum / n)[None]) * r.shape[-1]


class Critic(nnx.Module):
  """Value model: the decoder backbone plus a scalar value head (SAO §3.2).

  ``__call__(tokens [B, T], positions [B, T]) -> values [B, T] float32``; ``values[:, t]`` is the
  value of the state whose last token is ``tokens[:, t]`` (i.e. before generating token t+1).
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.backbone = Transformer(cfg, rngs=rngs)
    self.value_head = nnx.Linear(cfg.d_model, 1, use_bias=True, rngs=rngs,
                                 kernel_init=nnx.initializers.zeros_init())

  def __call__(self, tokens, positions):
    return self.with_aux(tokens, positions)[0]

  def with_aux(self, tokens, positions, aux_mask=None):
    """``(values [B, T] float32, aux)``: ``aux`` the backbone's router loss as
    ``Transformer.hidden_with_aux`` gives it (None for a dense backbone)."""
    h, aux = self.backbone.hidden_with_aux(tokens, positions, aux_mask=aux_mask)
    return self.value_head(h.astype(jnp.float32))[..., 0], aux


def init_cache(cfg: ModelConfig, batch: int, length: int, dtype=None) -> KVCache:
  """Zeros KV cache: per layer (k [batch, n_kv_heads, head_dim, length] -- keys transposed, see
  the module docstring -- and v [batch, n_kv_heads, length, head_dim])."""
  dtype = dtype or cfg.compute_dtype
  kshape = (batch, cfg.n_kv_heads, cfg.head_dim, length)
  vshape = (batch, cfg.n_kv_heads, length, cfg.head_dim)
  return [(jnp.zeros(kshape, dtype), jnp.zeros(vshape, dtype)) for _ in range(cfg.n_layers)]


def default_positions(tokens: jax.Array) -> jax.Array:
  """0..T-1 for every row: [B, T] int32."""
  return jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
