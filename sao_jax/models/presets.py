"""Registry of named model configs: tiny random presets for CPU runs and tests, and the shapes
of the real checkpoints the project is pointed at (loaded weights always take their config from
the checkpoint; these are for shape checks and random-init dry runs)."""

from __future__ import annotations

import dataclasses

from sao_jax.models.transformer import ModelConfig

PRESETS: dict[str, ModelConfig] = {
    # CPU-sized random models
    "tiny-qwen3": ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                              head_dim=16, d_ff=128, max_seq_len=256, arch="qwen3"),
    "tiny-qwen3-moe": ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4,
                                  n_kv_heads=2, head_dim=16, d_ff=128, max_seq_len=256,
                                  arch="qwen3_moe", tie_embeddings=False, n_experts=8,
                                  n_experts_per_tok=2, moe_d_ff=32, moe_layers=(0, 1),
                                  router_aux_loss_coef=0.001),
    "tiny-llama": ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                              head_dim=16, d_ff=128, max_seq_len=256, arch="llama",
                              qk_norm=False, rms_eps=1e-5),
    # real checkpoints' shapes
    "smollm2-135m": ModelConfig(vocab_size=49152, d_model=576, n_layers=30, n_heads=9,
                                n_kv_heads=3, head_dim=64, d_ff=1536, rope_theta=100000.0,
                                rms_eps=1e-5, tie_embeddings=True, qk_norm=False,
                                max_seq_len=8192, arch="llama"),
    "qwen3-0.6b": ModelConfig(vocab_size=151936, d_model=1024, n_layers=28, n_heads=16,
                              n_kv_heads=8, head_dim=128, d_ff=3072, rope_theta=1000000.0,
                              tie_embeddings=True, max_seq_len=40960, arch="qwen3",
                              param_dtype="bfloat16", dtype="bfloat16"),
    "qwen3-1.7b": ModelConfig(vocab_size=151936, d_model=2048, n_layers=28, n_heads=16,
                              n_kv_heads=8, head_dim=128, d_ff=6144, rope_theta=1000000.0,
                              tie_embeddings=True, max_seq_len=40960, arch="qwen3",
                              param_dtype="bfloat16", dtype="bfloat16"),
    "qwen3-8b": ModelConfig(vocab_size=151936, d_model=4096, n_layers=36, n_heads=32,
                            n_kv_heads=8, head_dim=128, d_ff=12288, rope_theta=1000000.0,
                            tie_embeddings=False, max_seq_len=40960, arch="qwen3",
                            param_dtype="bfloat16", dtype="bfloat16"),
    "qwen3-30b-a3b": ModelConfig(vocab_size=151936, d_model=2048, n_layers=48, n_heads=32,
                                 n_kv_heads=4, head_dim=128, d_ff=6144, rope_theta=1000000.0,
                                 tie_embeddings=False, max_seq_len=40960, arch="qwen3_moe",
                                 n_experts=128, n_experts_per_tok=8, moe_d_ff=768,
                                 moe_layers=tuple(range(48)), norm_topk_prob=True,
                                 router_aux_loss_coef=0.001, param_dtype="bfloat16",
                                 dtype="bfloat16"),
}


def get_preset(name: str, **overrides) -> ModelConfig:
  """The preset ``name`` with fields replaced by ``overrides`` (e.g. ``vocab_size=104``).

  Raises ValueError listing the known names."""
  if name not in PRESETS:
    raise ValueError(f"unknown model preset {name!r}; known: {sorted(PRESETS)}.")
  return dataclasses.replace(PRESETS[name], **overrides)
