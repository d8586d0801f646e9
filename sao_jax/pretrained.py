"""Pretrained models from the model role (``roles.Model``, ``run.model``): Hugging Face
checkpoint folders and GGUF files.

``model.checkpoint_dir`` holding a ``config.json`` is a Hugging Face checkpoint folder
(safetensors + ``tokenizer.json``); without one it is a sao_jax orbax run checkpoint (handled by
``sao_jax.train.checkpoint``). ``model.gguf`` ("" / a ``.gguf`` path / ``"smollm2"``) selects a
llama.cpp GGUF file instead. The tokenizer then comes from the same source.
``model.checkpoint_dir`` may also be a Hugging Face hub id (``Qwen/Qwen3-0.6B``), resolved to its
snapshot in the hub cache by ``checkpoint_dir`` (``sao_jax.hub``).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Optional

from sao_jax import hub, roles
from sao_jax.models.transformer import ModelConfig
from sao_jax.data.hf_tokenizer import HFTokenizer
from sao_jax.models import gguf_loader, hf
from sao_jax.models.gguf_loader import load_gguf
from sao_jax.models.hf import load_hf_checkpoint
from sao_jax.train import sharding


def is_run_folder(path: str) -> bool:
  """True for a sao_jax run folder (``run_dir``: a ``checkpoints/`` subfolder, or the
  ``config.json`` the driver writes, which has ``train`` and ``rollout`` sections), whose
  checkpoints are in ``<path>/checkpoints`` -- not a Hugging Face folder although it also holds
  a ``config.json``."""
  if os.path.isdir(os.path.join(path, "checkpoints")):
    return True
  try:
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
      conf = json.load(f)
  except (OSError, ValueError):
    return False
  return isinstance(conf, dict) and "train" in conf and "rollout" in conf


def checkpoint_dir(m: roles.Model) -> str:
  """``model.checkpoint_dir`` as a local folder: a Hugging Face hub id is resolved to its
  snapshot in the hub cache (``hub.resolve_checkpoint_dir``; raises FileNotFoundError naming the
  field when it is neither a folder nor cached offline); "" and folders are returned as given."""
  return hub.resolve_checkpoint_dir(m.checkpoint_dir)


def source(m: roles.Model) -> str:
  """"gguf", "hf", "orbax" or "random": where ``run.model``'s policy comes from."""
  if m.gguf:
    return "gguf"
  if m.checkpoint_dir:
    path = checkpoint_dir(m)
    hf = os.path.isfile(os.path.join(path, "config.json")) and not is_run_folder(path)
    return "hf" if hf else "orbax"
  return "random"


def load_tokenizer(m: roles.Model):
  """The checkpoint's ``HFTokenizer`` for "hf"/"gguf" sources, else None."""
  kind = source(m)
  if kind == "gguf":
    return HFTokenizer.from_gguf(m.gguf)
  if kind == "hf":
    return HFTokenizer.from_pretrained(checkpoint_dir(m))
  return None


def execution_fields(m: roles.Model) -> dict:
  """The ``ModelConfig`` fields that say how the forward runs, not what it computes, from
  ``run.model``: ``remat`` and ``scan_layers``."""
  return dict(remat=m.remat, scan_layers=bool(m.scan_layers))


def model_config(m: roles.Model, vocab_size: int):
  """The ``ModelConfig`` of a randomly initialised policy from ``run.model`` (the shapes a
  checkpoint does not give; parameters built in ``model.param_dtype``, computed in
  ``model.dtype``)."""
  return ModelConfig(vocab_size=vocab_size, d_model=m.d_model, n_layers=m.n_layers,
                     n_heads=m.n_heads, n_kv_heads=m.n_kv_heads, head_dim=m.head_dim,
                     d_ff=m.d_ff, rope_theta=m.rope_theta, max_seq_len=m.max_seq_len,
                     dtype=m.dtype, param_dtype=m.param_dtype,
                     **execution_fields(m))


def load_model(m: roles.Model, mesh=None) -> Optional[tuple]:
  """``(ModelConfig, params)`` for "hf"/"gguf" sources (shapes from the checkpoint, length and
  dtypes, remat and scan_layers from ``run.model``), else None.

  ``mesh``: a ``jax.sharding.Mesh`` (the learner's, ``build.make_mesh``) to load into:
  every parameter is placed tensor by tensor straight into its sharding there
  (``train.sharding.param_shardings``), each device receiving only its slices, so no device
  holds more than its share of the model. None: one device (the default device)."""
  kind = source(m)
  kw = dict(max_seq_len=m.max_seq_len, dtype=m.dtype, param_dtype=m.param_dtype)
  shardings = None
  if kind == "gguf":
    if mesh is not None:
      reader = gguf_loader.GGUFReader(gguf_loader.resolve_gguf_path(m.gguf))
      shardings = _param_shardings(gguf_loader.config_from_gguf(reader, **kw), mesh)
    loaded = load_gguf(m.gguf, shardings=shardings, **kw)
  elif kind == "hf":
    path = checkpoint_dir(m)
    if mesh is not None:
      shardings = _param_shardings(hf.config_from_hf(hf.read_hf_config(path), **kw), mesh)
    loaded = load_hf_checkpoint(path, shardings=shardings, **kw)
  else:
    return None
  mcfg, params = loaded
  return dataclasses.replace(mcfg, **execution_fields(m)), params


def _param_shardings(cfg: ModelConfig, mesh):
  """The learner's ``NamedSharding`` of every parameter of ``cfg`` on ``mesh``."""
  return sharding.param_shardings(hf.param_shapes(cfg), mesh)
