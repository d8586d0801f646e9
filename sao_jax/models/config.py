"""The decoder's static configuration (``ModelConfig``) and its rotary-embedding frequencies.

Kept apart from the modules (``transformer.py``) so that configs, loaders and presets can name
shapes without building a model.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import jax.numpy as jnp
import numpy as np

ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# model.remat: what the backward pass of a no-cache (training) forward keeps of each block
REMAT_POLICIES = ("none", "block", "dots_saveable")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Static shape/hyper-parameters of the decoder.

  Attributes:
    vocab_size: number of token ids (rows of the embedding).
    d_model: residual width.
    n_layers: number of transformer blocks.
    n_heads: query heads.
    n_kv_heads: key/value heads (``n_heads % n_kv_heads == 0``; GQA).
    head_dim: per-head width.
    d_ff: SwiGLU hidden width of the dense MLP layers.
    rope_theta: RoPE base frequency.
    rms_eps: RMSNorm epsilon.
    tie_embeddings: output projection = embedding matrix transposed.
    qk_norm: RMSNorm on queries and keys per head (Qwen3); False gives the Llama layout.
    max_seq_len: longest sequence (prompt + response) the model is used with.
    dtype: activation/compute dtype name ("float32" or "bfloat16").
    param_dtype: parameter storage dtype name ("float32" or "bfloat16"): what is built, loaded
      and served; the learner trains a float32 master copy (``train.optim.master_copy``).
    arch: Hugging Face ``model_type`` this config mirrors: "qwen3", "qwen3_moe" or "llama".
    attention_bias: biases on the q/k/v projections (and o when ``o_bias``).
    rope_scaling: None or a tuple of ``(key, value)`` pairs of the checkpoint's ``rope_scaling``
      (``rope_type`` one of ``ROPE_TYPES``); a tuple so the config stays hashable.
    n_experts: experts per MoE layer (0 = dense model).
    n_experts_per_tok: experts each token is routed to (top k).
    moe_d_ff: SwiGLU hidden width of one expert.
    moe_layers: indices of the layers whose MLP is a mixture of experts.
    norm_topk_prob: renormalise the top-k router probabilities to sum to 1 (Qwen3-MoE).
    router_aux_loss_coef: weight of the router load-balancing loss the policy and critic steps
      add to their losses (0 = not added).
    moe_impl: how MoE layers compute: "routed" (only each token's top-k experts, grouped
      matmuls; see ``transformer.moe_routed``) or "dense" (every expert for every token, the
      reference; cheaper on CPU, where ``jax.lax.ragged_dot`` has no grouped kernel).
    remat: rematerialisation of each block in a no-cache (training) forward, one of
      ``REMAT_POLICIES``: "none" (the backward keeps every block intermediate), "block"
      (``jax.checkpoint`` of each block, only its input kept: everything is recomputed in the
      backward, about one more forward of FLOPs), "dots_saveable" (the block's matmul outputs
      without batch dimensions -- the q/k/v/o and MLP projections -- kept, the rest, attention
      scores and probabilities included, recomputed; MaxText's "minimal"). Cached calls (prefill,
      decode) never rematerialise. See ``transformer.Transformer``.
    scan_layers: run the blocks of a no-cache forward with one ``jax.lax.scan`` per run of
      consecutive identical blocks (all of them for a dense model or an all-MoE one), so the
      compiled program holds one block body whatever the depth; parameters stay per layer
      (``layers/{i}/...``). Cached calls stay unrolled.
    ``remat`` and ``scan_layers`` change how the training forward runs, not its result (equal to
    rounding), so they are left out of ``repr`` (a model's identity, e.g. the SFT cache key).
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
  param_dtype: str = "float32"
  arch: str = "qwen3"
  attention_bias: bool = False
  o_bias: bool = False
  rope_scaling: Optional[tuple] = None
  n_experts: int = 0
  n_experts_per_tok: int = 0
  moe_d_ff: int = 0
  moe_layers: tuple = ()
  norm_topk_prob: bool = True
  router_aux_loss_coef: float = 0.0
  moe_impl: str = "routed"
  # how the training forward runs, not what it computes: left out of repr, which serves as the
  # model's identity (the SFT warm-start cache key, build.py:sft_key)
  remat: str = dataclasses.field(default="none", repr=False)
  scan_layers: bool = dataclasses.field(default=False, repr=False)

  def __post_init__(self):
    if self.n_heads % self.n_kv_heads:
      raise ValueError(
          f"model.n_heads={self.n_heads} must be a multiple of model.n_kv_heads="
          f"{self.n_kv_heads}; change one of them.")
    for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                 "d_ff", "max_seq_len"):
      if getattr(self, name) < 1:
        raise ValueError(f"model.{name} must be >= 1, got {getattr(self, name)}.")
    if self.head_dim % 2:
      raise ValueError(f"model.head_dim={self.head_dim} must be even (RoPE rotates pairs).")
    for name in ("dtype", "param_dtype"):
      if getattr(self, name) not in ("float32", "bfloat16", "float16", "float64"):
        raise ValueError(f"model.{name}={getattr(self, name)!r}; use 'float32' or 'bfloat16' "
                         "('float64' only under jax.enable_x64, for numerics checks).")
    if self.remat not in REMAT_POLICIES:
      raise ValueError(f"model.remat={self.remat!r}; use one of {REMAT_POLICIES} ('none' keeps "
                       "every activation, 'block' the least memory).")
    object.__setattr__(self, "scan_layers", bool(self.scan_layers))
    object.__setattr__(self, "moe_layers", tuple(int(i) for i in self.moe_layers))
    if self.moe_layers:
      if self.n_experts < 1 or not 1 <= self.n_experts_per_tok <= self.n_experts:
        raise ValueError(
            f"MoE layers {self.moe_layers} need model.n_experts >= 1 and 1 <= "
            f"model.n_experts_per_tok <= n_experts; got n_experts={self.n_experts}, "
            f"n_experts_per_tok={self.n_experts_per_tok}.")
      if self.moe_d_ff < 1:
        raise ValueError(f"model.moe_d_ff must be >= 1 for MoE layers, got {self.moe_d_ff}.")
      bad = [i for i in self.moe_layers if not 0 <= i < self.n_layers]
      if bad:
        raise ValueError(f"model.moe_layers has indices {bad} outside 0..{self.n_layers - 1}.")
    if self.moe_impl not in ("routed", "dense"):
      raise ValueError(f"model.moe_impl={self.moe_impl!r}; use 'routed' or 'dense'.")
    if self.rope_scaling is not None:
      rtype = self.rope_scaling_dict().get("rope_type", "default")
      if rtype not in ROPE_TYPES:
        raise ValueError(f"rope_scaling type {rtype!r} is not supported; supported: {ROPE_TYPES}.")

  @property
  def compute_dtype(self):
    return jnp.dtype(self.dtype)

  @property
  def params_dtype(self):
    return jnp.dtype(self.param_dtype)

  @property
  def is_moe(self) -> bool:
    return bool(self.moe_layers)

  def rope_scaling_dict(self) -> dict:
    return dict(self.rope_scaling or ())


def rope_frequencies(cfg: ModelConfig, dtype=np.float32) -> tuple[np.ndarray, float]:
  """Inverse frequencies [head_dim // 2] in ``dtype`` (float32; float64 for float64 models) and
  the cos/sin scale (``attention_factor``).

  Implements the Hugging Face ``ROPE_INIT_FUNCTIONS`` variants: ``default``
  (``theta ** (-2i / d)``), ``linear`` (divide by ``factor``), ``llama3`` (Llama 3.1 wavelength
  bands) and ``yarn`` (Peng et al. 2023, NTK-by-parts with ``0.1 ln(factor) + 1`` scaling).
  """
  d = cfg.head_dim
  inv = 1.0 / (cfg.rope_theta ** (np.arange(0, d, 2, dtype=dtype) / d))
  sc = cfg.rope_scaling_dict()
  rtype = sc.get("rope_type", sc.get("type", "default"))
  scale = 1.0
  if rtype == "linear":
    inv = inv / float(sc["factor"])
  elif rtype == "llama3":
    factor = float(sc["factor"])
    lo, hi = float(sc["low_freq_factor"]), float(sc["high_freq_factor"])
    old = float(sc["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    low_wl, high_wl = old / lo, old / hi
    smooth = (old / wavelen - lo) / (hi - lo)
    mid = (1 - smooth) * inv / factor + smooth * inv
    inv = np.where(wavelen > low_wl, inv / factor, np.where(wavelen < high_wl, inv, mid))
  elif rtype == "yarn":
    factor = float(sc["factor"])
    old = float(sc.get("original_max_position_embeddings") or cfg.max_seq_len)
    beta_fast, beta_slow = float(sc.get("beta_fast") or 32), float(sc.get("beta_slow") or 1)
    mscale = sc.get("attention_factor")
    scale = float(mscale) if mscale is not None else (0.1 * math.log(factor) + 1.0
                                                        if factor > 1 else 1.0)

    def dim_of(rot):
      return (d * math.log(old / (rot * 2 * math.pi))) / (2 * math.log(cfg.rope_theta))

    low = max(math.floor(dim_of(beta_fast)), 0)
    high = min(math.ceil(dim_of(beta_slow)), d - 1)
    if low == high:
      high += 0.001
    ramp = np.clip((np.arange(d // 2, dtype=dtype) - low) / (high - low), 0, 1)
    extrap = 1 - ramp
    inv = (inv / factor) * (1 - extrap) + inv * extrap
  return inv.astype(dtype), scale
