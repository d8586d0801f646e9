"""Supervised warm-up on demonstrations (gives the tiny policy a non-zero start)."""

from __future__ import annotations

import hashlib
import json
import os
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sao_jax.rollout.trajectory import bucket_length
from sao_jax.train import optim, steps
from flax import traverse_util
from safetensors.numpy import load_file, save_file


def pad_demos(demos: Sequence[tuple[Sequence[int], Sequence[int]]], pad_id: int,
              multiple: int = 32) -> dict[str, np.ndarray]:
  """[(ids, loss_mask)] -> {"tokens": int32 [N, T], "loss_mask": float32 [N, T]} right-padded."""
  t_len = bucket_length(max(len(ids) for ids, _ in demos), multiple)
  tokens = np.full((len(demos), t_len), pad_id, np.int32)
  mask = np.zeros((len(demos), t_len), np.float32)
  for i, (ids, m) in enumerate(demos):
    if len(ids) != len(m):
      raise ValueError(f"demo {i}: {len(ids)} tokens but {len(m)} loss_mask entries.")
    tokens[i, :len(ids)] = ids
    mask[i, :len(m)] = m
  return {"tokens": tokens, "loss_mask": mask}


def train_sft(graphdef, params, demos, *, pad_id: int, steps_: int, batch_size: int, lr: float,
              seed: int = 0, log_every: int = 0, log=print, on_step=None):
  """Runs ``steps_`` Adam steps of masked next-token cross-entropy on ``demos``.

  ``on_step(i)`` (optional) is called after step i (1-based), e.g. to advance a progress bar.
  Adam updates a float32 master copy of bf16 / f16 params (``optim.master_copy``; float32 moments)
  and the result is cast back to each parameter's dtype. Returns (params, last_loss)."""
  data = pad_demos(demos, pad_id)
  dtypes = jax.tree.map(lambda x: x.dtype, params)
  tx = optim.make_optimizer(params, lr=lr, warmup_steps=min(50, steps_ // 10))
  state = steps.TrainState.create(optim.master_copy(params), tx)
  step_fn = steps.make_sft_step(graphdef, tx)
  rng = np.random.default_rng(seed)
  n = data["tokens"].shape[0]
  loss = float("nan")
  for i in range(steps_):
    idx = rng.integers(0, n, batch_size)
    state, metrics = step_fn(state, {k: jnp.asarray(v[idx]) for k, v in data.items()})
    if on_step is not None:
      on_step(i + 1)
    if log_every and (i + 1) % log_every == 0:
      loss = float(metrics["sft_loss"])
      log(f"sft step {i + 1}/{steps_}  loss {loss:.4f}")
  out = jax.tree.map(lambda x, dt: x.astype(dt), state.params, dtypes)
  return out, float(metrics["sft_loss"]) if steps_ else loss


def cache_key(*parts) -> str:
  """A short sha256 of ``parts`` (JSON-serialised, keys sorted): the identity of a warm start."""
  blob = json.dumps(parts, sort_keys=True, default=str).encode()
  return hashlib.sha256(blob).hexdigest()[:16]


def cached_sft(cache_dir: str, key: str, params, train: Callable[[], tuple]) -> tuple:
  """Returns ``train()``'s ``(params, last_loss)``, stored in ``cache_dir/sft-<key>.safetensors``
  and reloaded from there when the same ``key`` comes again (``last_loss`` NaN then).

  The SFT warm-up is deterministic given its config, task and seed, so experiments that run many
  arms from the same seed train it once (the loaded parameters are bit-identical to retraining).
  ``cache_dir`` "" turns the cache off. The file is written to a temporary name and renamed, so a
  killed run never leaves a half-written warm start. ``params`` (a pure dict) gives the tree
  structure and dtypes (``train`` may donate its buffers); a cached file whose tensors do not
  match it raises ValueError naming the file (delete it to retrain)."""
  if not cache_dir:
    return train()
  path = os.path.join(cache_dir, f"sft-{key}.safetensors")
  def name(path_tuple):  # tuple keys keep int layer indices; the file uses "a/0/b" names
    return "/".join(map(str, path_tuple))
  flat = traverse_util.flatten_dict(params)
  if os.path.exists(path):
    stored = load_file(path)
    names = {name(k): k for k in flat}
    bad = sorted(set(stored) ^ set(names)) + [n for n, k in names.items() if n in stored and (
        stored[n].shape != tuple(flat[k].shape) or stored[n].dtype != flat[k].dtype)]
    if bad:
      raise ValueError(f"SFT cache {path} does not match the model (e.g. {bad[:3]}); delete the "
                       "file or set sft.cache_dir=''.")
    tree = traverse_util.unflatten_dict({k: jnp.asarray(stored[n]) for n, k in names.items()})
    return tree, float("nan")
  new_params, loss = train()
  os.makedirs(cache_dir, exist_ok=True)
  tmp = f"{path}.tmp{os.getpid()}"
  save_file({name(k): np.asarray(v) for k, v in traverse_util.flatten_dict(new_params).items()},
            tmp)
  os.replace(tmp, path)
  return new_params, loss
