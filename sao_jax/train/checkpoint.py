"""Orbax checkpoints of the SAO run state (policy/critic params and optimizer states, counters)."""

from __future__ import annotations

import os
from typing import Any, Optional

import jax
import orbax.checkpoint as ocp


class Checkpointer:
  """``save(step, state)`` every call (the caller decides when); keeps the newest ``max_to_keep``.

  ``state`` is a pytree (e.g. ``{"policy": TrainState, "critic": TrainState, "meta": {...}}``).
  ``restore(target)`` returns the latest complete checkpoint shaped like ``target`` or None.
  Orbax writes to a temporary folder and renames it when complete, so a half-written checkpoint
  is never picked up.
  """

  def __init__(self, directory: str, max_to_keep: int = 2):
    self.directory = os.path.abspath(directory)
    self.manager = ocp.CheckpointManager(
        self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True))

  def save(self, step: int, state: Any) -> None:
    self.manager.save(step, args=ocp.args.StandardSave(state))

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def latest_step(self) -> Optional[int]:
    return self.manager.latest_step()

  def restore(self, target: Any, step: Optional[int] = None) -> Optional[Any]:
    step = self.manager.latest_step() if step is None else step
    if step is None:
      return None
    return self.manager.restore(step, args=ocp.args.StandardRestore(target))

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()


def _match(target: Any, raw: Any, path: str = "") -> Any:
  """Rebuilds ``raw`` (a restored tree whose dict keys may have become strings) in the structure
  of ``target``; raises ValueError naming the first missing key or mismatched shape."""
  if isinstance(target, dict):
    if not isinstance(raw, dict):
      raise ValueError(f"checkpoint: expected a mapping at {path or '/'}, found {type(raw).__name__}.")
    out = {}
    for k, v in target.items():
      key = k if k in raw else str(k)
      if key not in raw:
        raise ValueError(f"checkpoint is missing parameter {path}/{k}.")
      out[k] = _match(v, raw[key], f"{path}/{k}")
    return out
  if tuple(target.shape) != tuple(raw.shape):
    raise ValueError(f"checkpoint parameter {path} has shape {tuple(raw.shape)}, the model "
                     f"expects {tuple(target.shape)}; check the model config.")
  return jax.numpy.asarray(raw, dtype=target.dtype)


def load_policy_params(directory: str, target_params: Any, step: Optional[int] = None) -> Any:
  """Policy params from a sao_jax run checkpoint folder (``<run_dir>/checkpoints``).

  ``target_params``: a freshly initialised pure-dict of the same model (gives structure, shapes
  and dtypes). Raises FileNotFoundError if the folder holds no complete checkpoint, ValueError on
  a missing tensor or a shape mismatch."""
  if not os.path.isdir(directory):
    raise FileNotFoundError(f"model.checkpoint_dir={directory!r} is not a folder.")
  manager = ocp.CheckpointManager(os.path.abspath(directory))
  step = manager.latest_step() if step is None else step
  if step is None:
    raise FileNotFoundError(f"no complete checkpoint in model.checkpoint_dir={directory!r}.")
  raw = manager.restore(step)
  manager.close()
  tree = raw.get("policy", raw) if isinstance(raw, dict) else raw
  tree = tree.get("params", tree) if isinstance(tree, dict) else tree
  return _match(target_params, tree)
