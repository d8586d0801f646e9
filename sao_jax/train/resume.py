"""Exact resume and fault guards for the SAO main job (hooks used by ``sao_jax/train/loop.py``).

* the prompt ledger (exactly-once prompts) is ``sao_jax.rollout.ledger``; lockstep rollout
  (``rollout.lockstep=True``, bit-exact resume) is ``sao_jax.rollout.source.ThreadSource``.
* ``NonFiniteGuard`` -- counts policy steps whose loss or gradients were NaN/inf (their updates
  are dropped by ``optax.apply_if_finite`` in ``train/optim.py``) and stops the run with a clear
  message after ``max_consecutive`` in a row.
* ``truncate_jsonl`` -- drops metric/ledger records of steps after the restored checkpoint, so
  redone steps are not logged twice.

RNG: every key is derived from ``config.seed`` and the step (``lockstep``) or the resumed step
(the asynchronous worker's decode key), so the checkpoint's ``seed`` and ``step`` fix them.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Optional

from sao_jax import roles
from sao_jax.train.checkpoint import Checkpointer
from sao_jax.train.metrics import require_wandb


class ResumeError(ValueError):
  """The run folder cannot be resumed with this config (the message names the fix)."""


class NonFiniteError(RuntimeError):
  """The run stopped: too many policy steps in a row had NaN/inf loss or gradients."""


class NonFiniteGuard:
  """``check(step, metrics)`` -> True if this step's update was skipped (non-finite
  ``policy_loss``, ``policy_grad_norm``, ``value_loss`` or ``critic_grad_norm``); raises
  ``NonFiniteError`` after ``max_consecutive`` skipped steps in a row."""

  KEYS = ("policy_loss", "policy_grad_norm", "value_loss", "critic_grad_norm")

  def __init__(self, max_consecutive: int = 3):
    if max_consecutive < 1:
      raise ValueError(f"train.max_consecutive_nonfinite must be >= 1, got {max_consecutive}.")
    self.max_consecutive = max_consecutive
    self.consecutive = 0
    self.total = 0

  def check(self, step: int, metrics: dict) -> bool:
    bad = [k for k in self.KEYS if k in metrics and not math.isfinite(float(metrics[k]))]
    if not bad:
      self.consecutive = 0
      return False
    self.consecutive += 1
    self.total += 1
    print(f"step {step}: non-finite {', '.join(bad)}; update skipped "
          f"({self.consecutive} in a row, {self.total} in total)", flush=True)
    if self.consecutive >= self.max_consecutive:
      raise NonFiniteError(
          f"stopping at step {step}: {self.consecutive} policy steps in a row had non-finite "
          f"{', '.join(bad)} (limit train.max_consecutive_nonfinite={self.max_consecutive}); no "
          "update was applied in those steps and the last checkpoint is intact. Lower "
          "train.policy_lr / critic_lr, check the reward for NaN, or resume from the checkpoint.")
    return True


def truncate_jsonl(path: str, max_step: int) -> int:
  """Rewrites ``path`` keeping records with ``step <= max_step`` (atomically: temp + rename);
  returns the number of records dropped. A missing file is left alone; a torn last line
  (killed mid-write) is dropped."""
  if not os.path.exists(path):
    return 0
  kept, dropped = [], 0
  with open(path, encoding="utf-8") as f:
    for line in f:
      try:
        rec = json.loads(line)
      except json.JSONDecodeError:
        dropped += 1
        continue
      if rec.get("step", 0) <= max_step:
        kept.append(line if line.endswith("\n") else line + "\n")
      else:
        dropped += 1
  tmp = path + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    f.writelines(kept)
  os.replace(tmp, path)
  return dropped


def resume_point(directory: str) -> Optional[int]:
  """Latest complete checkpoint step in ``directory`` (None if none); half-written ones
  (orbax temporary folders) are never returned."""
  if not os.path.isdir(directory):
    return None
  ck = Checkpointer(directory)
  try:
    return ck.latest_step()
  finally:
    ck.close()


# Fields that may change when a run is resumed: how long it runs, how it checkpoints, logs and
# evaluates, where its processes meet, and how the forward saves memory (remat, scan over layers:
# same results to rounding). Anything else changes *what* is trained.
RESUMABLE_CHANGES = ("run_dir", "train.num_steps", "checkpoint.", "log.", "eval.", "distributed.",
                     "model.remat", "model.scan_layers")


def _flat(tree: dict, prefix: str = "") -> dict:
  out = {}
  for k, v in tree.items():
    if isinstance(v, dict):
      out.update(_flat(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = v
  return out


def check_resume_config(run_dir: str, config_json: str, resume_step: Optional[int],
                        num_steps: int) -> None:
  """Refuses to resume ``run_dir`` (whose latest complete checkpoint is ``resume_step``) with a
  config that trains something else.

  ``config_json``: the new resolved config as JSON (``dataclasses.asdict`` of the ``roles.Run``);
  it is compared with ``run_dir/config.json`` written by the run that made the checkpoint.
  Only the fields in ``RESUMABLE_CHANGES`` may differ. Raises ValueError naming every other
  changed field (old and new value) and the fix; and when ``num_steps < resume_step`` (the
  checkpoint is already past the requested end). No-op when there is nothing to resume or no
  saved config."""
  if resume_step is None:
    return
  fix = ("use a new --config.run_dir, or --config.checkpoint.resume=False to start over in "
         "this folder")
  if num_steps < resume_step:
    raise ResumeError(f"{run_dir} has a checkpoint at step {resume_step}, past "
                     f"train.num_steps={num_steps}: nothing left to train. Raise "
                     f"--config.train.num_steps to continue that run, or {fix}.")
  path = os.path.join(run_dir, "config.json")
  if not os.path.exists(path):
    return
  with open(path, encoding="utf-8") as f:
    old = _flat(json.load(f))
  new = _flat(json.loads(config_json))
  changed = [k for k in sorted(set(old) | set(new))
             if old.get(k) != new.get(k) and not any(
                 k == p or (p.endswith(".") and k.startswith(p)) for p in RESUMABLE_CHANGES)]
  if changed:
    diff = ", ".join(f"{k} (was {old.get(k)!r}, now {new.get(k)!r})" for k in changed[:8])
    more = f" and {len(changed) - 8} more" if len(changed) > 8 else ""
    raise ResumeError(f"{run_dir} holds a checkpoint (step {resume_step}) of a run with another "
                     f"config: {diff}{more}. Resuming would continue that run, not this one; "
                     f"{fix}.")


def prepare_run_dir(config: roles.Run) -> tuple[Optional[int], str]:
  """Creates ``run_dir``; finds the checkpoint to resume from (``checkpoint.resume``), refuses
  a run folder made with another config (``check_resume_config``), writes the resolved
  ``config.json`` and drops metric / ledger records of steps after the checkpoint (all of them
  on a fresh start). Returns ``(resume_step or None, checkpoint folder)``. Raises ImportError
  at once if ``log.wandb_project`` is set without wandb installed, ``ResumeError`` naming
  ``run_dir`` if the folder or its ``config.json`` cannot be written."""
  run_dir = config.run_dir
  ckpt_dir = os.path.join(run_dir, "checkpoints")
  try:  # validation checked the folder; this catches what it cannot see (a full disk, a race)
    os.makedirs(run_dir, exist_ok=True)
    resume_step = resume_point(ckpt_dir) if config.checkpoint.resume else None
    config_json = json.dumps(dataclasses.asdict(config), indent=2)  # every field, resolved
    check_resume_config(run_dir, config_json, resume_step, config.train.num_steps)
    with open(os.path.join(run_dir, "config.json"), "w", encoding="utf-8") as f:
      f.write(config_json)
  except OSError as e:
    raise ResumeError(f"config.run_dir = {run_dir!r} cannot be written ({type(e).__name__}: "
                      f"{e.strerror or e}); fix: use a folder you can write to, e.g. "
                      "--config.run_dir=$HOME/sao_runs/my_run") from e
  if config.log.wandb_project:
    require_wandb()  # fail now, not after the warm-up
  for name in ("metrics.jsonl", "ledger.jsonl"):
    truncate_jsonl(os.path.join(run_dir, name), -1 if resume_step is None else resume_step)
  if resume_step is not None:
    print(f"resuming from {ckpt_dir} step {resume_step}", flush=True)
  return resume_step, ckpt_dir
