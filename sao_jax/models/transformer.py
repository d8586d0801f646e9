"""Qwen3-style decoder-only transformer and critic in Flax NNX.

Architecture (Qwen3 dense, https://huggingface.co/docs/transformers/model_doc/qwen3):
RMSNorm pre-norm blocks; rotary position embeddings (rotate-half layout, as Hugging Face);
grouped-query attention with RMSNorm on q and k per head; SwiGLU MLP; optionally tied
input/output embeddings.

Both modules take explicit ``positions`` so the same code serves training (full sequences,
causal mask), prefill (a chunk appended after an existing KV cache) and decoding (one token per
row, every row at its own position). The KV cache is a plain pytree:
``[(k, v) for each layer]`` with ``k, v: [batch, cache_len, n_kv_heads, head_dim]``.

Parameter paths: every attention parameter lives under ``...['attn']...`` so optimizers can freeze
them by pattern (see ``sao_jax.train.optim``).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

KVCache = list  # list[tuple[jax.Array, jax.Array]], one (k, v) per layer


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Static shape/hyper-parameters of the decoder.

  Attributes:
    vocab_size: number of token ids.
    d_model: residual width.
    n_layers: number of transformer blocks.
    n_heads: query heads.
    n_kv_heads: key/value heads (``n_heads % n_kv_heads == 0``; GQA).
    head_dim: per-head width.
    d_ff: SwiGLU hidden width.
    rope_theta: RoPE base frequency.
    rms_eps: RMSNorm epsilon.
    tie_embeddings: output projection = embedding matrix transposed.
    qk_norm: RMSNorm on queries and keys per head (Qwen3); False gives the Llama layout.
    max_seq_len: longest sequence (prompt + response) the model is used with.
    dtype: activation/compute dtype name ("float32" or "bfloat16"); params are float32.
  """

  vocab_size: int
  d_model: int = 128
  n_layers: int = 2
  n_heads: int = 4
  n_kv_heads: int = 2
  head_dim: int = 32
  d_ff: int = 384
  rope_theta: float = 10000.0
  rms_eps: float = 1e-6
  tie_embeddings: bool = True
  qk_norm: bool = True
  max_seq_len: int = 256
  dtype: str = "float32"

  def __post_init__(self):
    if self.n_heads % self.n_kv_heads:
      raise ValueError(
          f"model.n_heads={self.n_heads} must be a multiple of model.n_kv_heads="
          f"{self.n_kv_heads}; change one of them.")
    for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                 "d_ff", "max_seq_len"):
      if getattr(self, name) < 1:
        raise ValueError(f"model.{name} must be >= 1, got {getattr(self, name)}.")

  @property
  def compute_dtype(self):
    return jnp.dtype(self.dtype)


class RMSNorm(nnx.Module):
  """y = x / sqrt(mean(x^2) + eps) * scale, computed in float32."""

  def __init__(self, dim: int, eps: float):
    self.scale = nnx.Param(jnp.ones((dim,), jnp.float32))
    self.eps = eps

  def __call__(self, x):
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (y * self.scale[...]).astype(x.dtype)


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
  """Rotary embedding, rotate-half layout. x: [B, T, H, D]; positions: [B, T] int."""
  d = x.shape[-1]
  inv_freq = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
  angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
  cos = jnp.cos(angles)[:, :, None, :]
  sin = jnp.sin(angles)[:, :, None, :]
  x32 = x.astype(jnp.float32)
  x1, x2 = x32[..., : d // 2], x32[..., d // 2:]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


def _linear(rngs, din, dout):
  return nnx.Linear(din, dout, use_bias=False, rngs=rngs,
                    kernel_init=nnx.initializers.normal(stddev=din ** -0.5))


class Attention(nnx.Module):
  """Grouped-query attention with per-head q/k RMSNorm and a KV cache."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    self.q_proj = _linear(rngs, cfg.d_model, cfg.n_heads * cfg.head_dim)
    self.k_proj = _linear(rngs, cfg.d_model, cfg.n_kv_heads * cfg.head_dim)
    self.v_proj = _linear(rngs, cfg.d_model, cfg.n_kv_heads * cfg.head_dim)
    self.o_proj = _linear(rngs, cfg.n_heads * cfg.head_dim, cfg.d_model)
    if cfg.qk_norm:
      self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_eps)
      self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_eps)

  def __call__(self, x, positions, cache: Optional[tuple] = None):
    cfg = self.cfg
    b, t, _ = x.shape
    q = self.q_proj(x).reshape(b, t, cfg.n_heads, cfg.head_dim)
    k = self.k_proj(x).reshape(b, t, cfg.n_kv_heads, cfg.head_dim)
    v = self.v_proj(x).reshape(b, t, cfg.n_kv_heads, cfg.head_dim)
    if cfg.qk_norm:
      q, k = self.q_norm(q), self.k_norm(k)
    q = rope(q, positions, cfg.rope_theta)
    k = rope(k, positions, cfg.rope_theta)
    if cache is None:
      keys, values, key_pos = k, v, positions
      new_cache = None
    else:
      ck, cv = cache
      start = positions[:, 0]
      write = jax.vmap(lambda c, u, s: jax.lax.dynamic_update_slice(c, u, (s, 0, 0)))
      keys = write(ck, k.astype(ck.dtype), start)
      values = write(cv, v.astype(cv.dtype), start)
      key_pos = jnp.broadcast_to(jnp.arange(ck.shape[1]), (b, ck.shape[1]))
      new_cache = (keys, values)
    groups = cfg.n_heads // cfg.n_kv_heads
    q = q.reshape(b, t, cfg.n_kv_heads, groups, cfg.head_dim)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, keys.astype(q.dtype)).astype(jnp.float32)
    scores = scores * (cfg.head_dim ** -0.5)
    mask = key_pos[:, None, :] <= positions[:, :, None]  # [B, T, S] causal on absolute positions
    scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, values.astype(x.dtype))
    out = out.reshape(b, t, cfg.n_heads * cfg.head_dim)
    return self.o_proj(out), new_cache


class MLP(nnx.Module):
  """SwiGLU: down(silu(gate(x)) * up(x))."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.gate_proj = _linear(rngs, cfg.d_model, cfg.d_ff)
    self.up_proj = _linear(rngs, cfg.d_model, cfg.d_ff)
    self.down_proj = _linear(rngs, cfg.d_ff, cfg.d_model)

  def __call__(self, x):
    return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nnx.Module):

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.attn_norm = RMSNorm(cfg.d_model, cfg.rms_eps)
    self.attn = Attention(cfg, rngs)
    self.mlp_norm = RMSNorm(cfg.d_model, cfg.rms_eps)
    self.mlp = MLP(cfg, rngs)

  def __call__(self, x, positions, cache=None):
    h, new_cache = self.attn(self.attn_norm(x), positions, cache)
    x = x + h
    x = x + self.mlp(self.mlp_norm(x))
    return x, new_cache


class Transformer(nnx.Module):
  """Decoder-only LM. ``__call__`` returns ``(logits [B, T, V] float32, new_cache)``.

  Args (call):
    tokens: int32 [B, T].
    positions: int32 [B, T], absolute positions; with a cache, row b's chunk is written at
      ``positions[b, 0] ... positions[b, 0] + T - 1`` (contiguous).
    cache: None (no cache, causal attention among the T tokens) or a ``KVCache`` whose
      entries at positions < positions[b, 0] are valid for row b.
    return_hidden: also return the final normed hidden states [B, T, D].
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, rngs=rngs,
                           embedding_init=nnx.initializers.normal(stddev=1.0))
    self.layers = nnx.List([Block(cfg, rngs) for _ in range(cfg.n_layers)])
    self.final_norm = RMSNorm(cfg.d_model, cfg.rms_eps)
    if not cfg.tie_embeddings:
      self.lm_head = _linear(rngs, cfg.d_model, cfg.vocab_size)

  def hidden(self, tokens, positions, cache: Optional[KVCache] = None):
    x = self.embed(tokens).astype(self.cfg.compute_dtype)
    new_cache = []
    for i, layer in enumerate(self.layers):
      x, c = layer(x, positions, None if cache is None else cache[i])
      new_cache.append(c)
    return self.final_norm(x), (None if cache is None else new_cache)

  def __call__(self, tokens, positions, cache: Optional[KVCache] = None):
    h, new_cache = self.hidden(tokens, positions, cache)
    if self.cfg.tie_embeddings:
      logits = self.embed.attend(h.astype(jnp.float32))
    else:
      logits = self.lm_head(h)
    return logits.astype(jnp.float32), new_cache


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
    h, _ = self.backbone.hidden(tokens, positions)
    return self.value_head(h.astype(jnp.float32))[..., 0]


def init_cache(cfg: ModelConfig, batch: int, length: int, dtype=None) -> KVCache:
  """Zeros KV cache: per layer (k, v) of shape [batch, length, n_kv_heads, head_dim]."""
  dtype = dtype or cfg.compute_dtype
  shape = (batch, length, cfg.n_kv_heads, cfg.head_dim)
  return [(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(cfg.n_layers)]


def default_positions(tokens: jax.Array) -> jax.Array:
  """0..T-1 for every row: [B, T] int32."""
  return jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
