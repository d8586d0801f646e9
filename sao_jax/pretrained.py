"""Pretrained models from the config: Hugging Face checkpoint folders and GGUF files.

``config.model.checkpoint_dir`` holding a ``config.json`` is a Hugging Face checkpoint folder
(safetensors + ``tokenizer.json``); without one it is a sao_jax orbax run checkpoint (handled by
``sao_jax.train.checkpoint``). ``config.model.gguf`` ("" / a ``.gguf`` path / ``"smollm2"``)
selects a llama.cpp GGUF file instead. The tokenizer then comes from the same source.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

from sao_jax.models.transformer import ModelConfig
from sao_jax.data.hf_tokenizer import HFTokenizer
from sao_jax.models.gguf_loader import load_gguf
from sao_jax.models.hf import load_hf_checkpoint


def source(config) -> str:
  """"gguf", "hf", "orbax" or "random"."""
  m = config.model
  if m.get("gguf", ""):
    return "gguf"
  if m.checkpoint_dir:
    return "hf" if os.path.isfile(os.path.join(m.checkpoint_dir, "config.json")) else "orbax"
  return "random"


def load_tokenizer(config):
  """The checkpoint's ``HFTokenizer`` for "hf"/"gguf" sources, else None."""
  kind = source(config)
  if kind == "gguf":
    return HFTokenizer.from_gguf(config.model.gguf)
  if kind == "hf":
    return HFTokenizer.from_pretrained(config.model.checkpoint_dir)
  return None


def execution_fields(config) -> dict:
  """The ``ModelConfig`` fields that say how the forward runs, not what it computes, from
  ``config.model``: ``remat`` and ``scan_layers`` (defaults "none" / False when absent)."""
  m = config.model
  return dict(remat=m.get("remat", "none"), scan_layers=bool(m.get("scan_layers", False)))


def model_config(config, vocab_size: int):
  """The ``ModelConfig`` of a randomly initialised policy from ``config.model`` (the shapes a
  checkpoint does not give)."""
  m = config.model
  return ModelConfig(vocab_size=vocab_size, d_model=m.d_model, n_layers=m.n_layers,
                     n_heads=m.n_heads, n_kv_heads=m.n_kv_heads, head_dim=m.head_dim,
                     d_ff=m.d_ff, rope_theta=m.rope_theta, max_seq_len=m.max_seq_len,
                     dtype=m.dtype, **execution_fields(config))


def load_model(config) -> Optional[tuple]:
  """``(ModelConfig, params)`` for "hf"/"gguf" sources (shapes from the checkpoint, length,
  dtypes, remat and scan_layers from ``config.model``), else None."""
  kind = source(config)
  kw = dict(max_seq_len=config.model.max_seq_len, dtype=config.model.dtype,
            param_dtype=config.model.get("param_dtype", "float32"))
  if kind == "gguf":
    loaded = load_gguf(config.model.gguf, **kw)
  elif kind == "hf":
    loaded = load_hf_checkpoint(config.model.checkpoint_dir, **kw)
  else:
    return None
  mcfg, params = loaded
  return dataclasses.replace(mcfg, **execution_fields(config)), params
