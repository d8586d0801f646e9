"""Metric logging: stdout lines, JSONL + CSV files, TensorBoard event files, optional W&B.

Metric names and units: ``sao_jax/train/metric_defs.py`` (rendered in ``docs/metrics.md``)."""

from __future__ import annotations

import csv
import json
import math
import os
import sys
from typing import Any, Optional


def require_wandb():
  """The ``wandb`` module; raises ImportError saying how to install it or switch it off."""
  try:
    import wandb  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise ImportError("log.wandb_project is set but wandb is not installed: `pip install wandb` "
                      "(and `wandb login`), or leave --config.log.wandb_project empty.") from e
  return wandb


class MetricLogger:
  """Writes one record per step to ``run_dir/metrics.jsonl`` and TensorBoard (tensorboardX),
  prints a short line for the keys in ``console_keys``, and on ``close`` writes
  ``run_dir/metrics.csv`` (columns = union of all keys).

  ``wandb_project``: also log every numeric metric to Weights & Biases (run files under
  ``run_dir``); None (default) = off. Raises ImportError with the fix when it is asked for and
  ``wandb`` is not installed (it is optional, not in requirements.txt)."""

  def __init__(self, run_dir: str, console_keys=(), tensorboard: bool = True, stream=None,
               wandb_project: Optional[str] = None, wandb_config: Optional[dict] = None):
    os.makedirs(run_dir, exist_ok=True)
    self.run_dir = run_dir
    self.console_keys = tuple(console_keys)
    self.stream = stream or sys.stdout
    self.records: list[dict] = []
    self._jsonl = open(os.path.join(run_dir, "metrics.jsonl"), "a", encoding="utf-8")
    self._tb = None
    if tensorboard:
      try:
        from tensorboardX import SummaryWriter  # pylint: disable=import-outside-toplevel
        self._tb = SummaryWriter(os.path.join(run_dir, "tb"))
      except ImportError:
        self._tb = None
    self._wandb = None
    if wandb_project:
      wandb = require_wandb()
      self._wandb = wandb.init(project=wandb_project, dir=run_dir, config=wandb_config or {},
                               name=os.path.basename(os.path.normpath(run_dir)))

  def log(self, step: int, metrics: dict[str, Any], prefix: str = "") -> None:
    rec = {"step": step}
    rec.update({prefix + k: (float(v) if isinstance(v, (int, float)) or hasattr(v, "item") else v)
                for k, v in metrics.items()})
    self.records.append(rec)
    self._jsonl.write(json.dumps(rec) + "\n")
    self._jsonl.flush()
    if self._tb is not None:
      for k, v in rec.items():
        if k != "step" and isinstance(v, float) and math.isfinite(v):
          self._tb.add_scalar(k, v, step)
    if self._wandb is not None:
      # W&B needs a monotonic step of its own (critic warm-up records restart at 0), so the
      # record's step travels as the field "step" (choose it as the x-axis in the W&B UI).
      self._wandb.log({k: v for k, v in rec.items() if isinstance(v, (int, float))})
    shown = [f"{k} {rec[k]:.4g}" for k in self.console_keys if isinstance(rec.get(k), float)]
    if shown:
      print(f"[{prefix or 'train'} {step:4d}] " + "  ".join(shown), file=self.stream, flush=True)

  def close(self) -> Optional[str]:
    self._jsonl.close()
    if self._tb is not None:
      self._tb.close()
    if self._wandb is not None:
      self._wandb.finish()
      self._wandb = None
    if not self.records:
      return None
    keys = sorted({k for r in self.records for k in r}, key=lambda k: (k != "step", k))
    path = os.path.join(self.run_dir, "metrics.csv")
    with open(path, "w", newline="", encoding="utf-8") as f:
      w = csv.DictWriter(f, fieldnames=keys)
      w.writeheader()
      w.writerows(self.records)
    return path
