"""Orbax checkpoints of the SAO run state (policy/critic params and optimizer states, counters)."""

from __future__ import annotations

import os
import shutil
from typing import Any, Optional

import jax
import orbax.checkpoint as ocp


class CheckpointError(RuntimeError):
  """A checkpoint could not be written; the previous complete checkpoint is intact."""


def _dir_bytes(path: str) -> int:
  total = 0
  for root, _, files in os.walk(path):
    for f in files:
      try:
        total += os.path.getsize(os.path.join(root, f))
      except OSError:
        pass
  return total


class Checkpointer:
  """``save(step, state)`` every call (the caller decides when); keeps the newest ``max_to_keep``.

  ``state`` is a pytree (e.g. ``{"policy": TrainState, "critic": TrainState, "meta": {...}}``);
  ``meta`` (JSON: counters, the prompt ledger's cursor ...) is stored as the step's orbax custom
  metadata, committed together with the arrays. ``restore(target)`` returns the latest complete
  checkpoint shaped like ``target`` or None. Orbax writes to a temporary folder and renames it
  when complete, so a half-written checkpoint is never picked up.

  Saves are asynchronous (orbax). Before a save, free space is checked against the size of the
  last checkpoint (x ``space_margin``); a save that cannot fit, or that fails while writing,
  raises ``CheckpointError`` naming the folder and the free space -- the previous checkpoint
  stays complete and restorable.
  """

  def __init__(self, directory: str, max_to_keep: int = 2, space_margin: float = 1.2):
    self.directory = os.path.abspath(directory)
    self.space_margin = space_margin
    self.manager = ocp.CheckpointManager(
        self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True))

  def _raise_disk(self, step: int, cause: Optional[BaseException], need: int = 0):
    free = shutil.disk_usage(self.directory).free
    prev = self.manager.latest_step()
    raise CheckpointError(
        f"checkpoint step {step} could not be written to {self.directory}: "
        f"{cause or 'not enough free space'} ({free / 2**20:.1f} MiB free"
        + (f", about {need / 2**20:.1f} MiB needed" if need else "") + "). "
        + (f"The previous checkpoint (step {prev}) is intact; " if prev is not None else "")
        + "free disk space or point run_dir at a larger disk, then resume.") from cause

  def save(self, step: int, state: Any, meta: Optional[dict] = None) -> None:
    """Starts an asynchronous save of ``state`` (+ JSON ``meta``) as ``step``.

    Raises CheckpointError if the disk cannot hold it or the previous save failed."""
    try:
      self.manager.wait_until_finished()  # surfaces a failure of the previous async save
    except OSError as e:
      self._raise_disk(step, e)
    prev = self.manager.latest_step()
    if prev is not None:
      need = int(_dir_bytes(os.path.join(self.directory, str(prev))) * self.space_margin)
      if shutil.disk_usage(self.directory).free < need:
        self._raise_disk(step, None, need)
    try:
      self.manager.save(step, args=ocp.args.StandardSave(state), custom_metadata=meta or {})
    except OSError as e:
      self._raise_disk(step, e)

  def wait(self) -> None:
    try:
      self.manager.wait_until_finished()
    except OSError as e:
      self._raise_disk(-1, e)

  def latest_step(self) -> Optional[int]:
    return self.manager.latest_step()

  def meta(self, step: Optional[int] = None) -> dict:
    """The JSON ``meta`` saved with ``step`` (default: latest); {} if none."""
    step = self.manager.latest_step() if step is None else step
    if step is None:
      return {}
    return dict(self.manager.metadata(step).custom_metadata or {})

  def restore(self, target: Any, step: Optional[int] = None) -> Optional[Any]:
    step = self.manager.latest_step() if step is None else step
    if step is None:
      return None
    return self.manager.restore(step, args=ocp.args.StandardRestore(target))

  def close(self) -> None:
    self.wait()
    self.manager.close()


def _match(target: Any, raw: Any, path: str = "") -> Any:
  """Rebuilds ``raw`` (a restored tree whose dict keys may have become strings) in the structure
  of ``target``; raises ValueError naming the first missing key or mismatched shape."""
  if isinstance(target, dict):
    if not isinstance(raw, dict):
      raise ValueError(
          f"checkpoint: expected a mapping at {path or '/'}, found {type(raw).__name__}.")
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
    manager.close()
    inner = os.path.join(directory, "checkpoints")
    hint = (f"; it is a run folder: its checkpoints are in {inner!r}, so use "
            f"--config.model.checkpoint_dir={inner}" if os.path.isdir(inner) else
            "; give a run's checkpoints folder (<run_dir>/checkpoints)")
    raise FileNotFoundError(f"no complete checkpoint in model.checkpoint_dir={directory!r}"
                            f"{hint}.")
  raw = manager.restore(step)
  manager.close()
  tree = raw.get("policy", raw) if isinstance(raw, dict) else raw
  tree = tree.get("params", tree) if isinstance(tree, dict) else tree
  return _match(target_params, tree)
