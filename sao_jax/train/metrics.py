"""Metric writing through CLU ``metric_writers``: ``run_dir/metrics.jsonl`` (+ ``metrics.csv`` at
close), TensorBoard event files under ``run_dir/tb``, a console line, optional W&B.

One entry point: ``make_metric_writer(run_dir, ...)`` returns a ``RunWriter`` with
``.log(step, metrics, prefix="")`` and ``.close() -> metrics.csv path or None``. On process 0 it
composes, with ``clu.metric_writers.MultiWriter``:

* ``JsonlCsvWriter``  -- one JSON record per ``log`` call, every value (lists too), CSV at close;
* ``TensorboardXWriter`` -- finite scalars as TensorBoard scalars (``log.tensorboard``);
* ``ConsoleWriter``   -- ``[train  12] reward_mean 0.5  ...`` for the ``console_keys``;
* ``WandbWriter``     -- numeric metrics to Weights & Biases (``log.wandb_project``).

On other processes it is ``clu.metric_writers.create_default_writer(just_logging=True)``: a
``LoggingWriter`` (absl INFO lines in that host's own log), no files.

Metric names and units: ``sao_jax/train/metric_defs.py`` (rendered in ``docs/metrics.md``)."""

from __future__ import annotations

import csv
import importlib.util
import json
import math
import os
import sys
import types
from typing import Any, Mapping, Optional, Sequence


def _allow_clu_without_tensorflow() -> None:
  """clu 0.0.12's ``clu/metric_writers/__init__.py`` imports its TF summary writer, hence
  TensorFlow, eagerly (lazy import proposed in google/CommonLoopUtils PR #358, not released).
  sao_jax writes TensorBoard files with tensorboardX, so when TensorFlow is not installed the one
  TF-backed submodule is replaced by a stand-in whose ``SummaryWriter`` raises ImportError; the
  rest of the package (interface, MultiWriter, LoggingWriter, AsyncWriter, create_default_writer
  without a logdir) imports and works unchanged."""
  name = "clu.metric_writers.summary_writer"
  if name in sys.modules or importlib.util.find_spec("tensorflow") is not None:
    return

  def tf_summary_writer(*args, **kwargs):
    del args, kwargs
    raise ImportError("clu.metric_writers.SummaryWriter needs TensorFlow, which sao_jax does not "
                      "install; use sao_jax.train.metrics.TensorboardXWriter.")

  stub = types.ModuleType(name)
  stub.SummaryWriter = tf_summary_writer
  sys.modules[name] = stub


_allow_clu_without_tensorflow()
# pylint: disable=wrong-import-position
import jax
import numpy as np
from clu.metric_writers import MultiWriter, create_default_writer
from clu.metric_writers import interface
# pylint: enable=wrong-import-position


def require_wandb():
  """The ``wandb`` module; raises ImportError saying how to install it or switch it off."""
  try:
    import wandb  # pylint: disable=import-outside-toplevel  (optional dependency)
  except ImportError as e:
    raise ImportError("log.wandb_project is set but wandb is not installed: `pip install wandb` "
                      "(and `wandb login`), or leave --config.log.wandb_project empty.") from e
  return wandb


class _ScalarWriter(interface.MetricWriter):
  """Base of the writers below: every ``write_*`` but ``write_scalars`` is a no-op."""

  def write_summaries(self, step, values, metadata=None):
    del step, values, metadata

  def write_scalars(self, step, scalars):
    del step, scalars

  def write_images(self, step, images):
    del step, images

  def write_videos(self, step, videos):
    del step, videos

  def write_audios(self, step, audios, *, sample_rate):
    del step, audios, sample_rate

  def write_texts(self, step, texts):
    del step, texts

  def write_histograms(self, step, arrays, num_buckets=None):
    del step, arrays, num_buckets

  def write_hparams(self, hparams):
    del hparams

  def flush(self):
    pass

  def close(self):
    pass


def _plain(v: Any) -> Any:
  """A JSON-ready value: arrays/np scalars -> Python lists/numbers, anything else unchanged."""
  return v.tolist() if hasattr(v, "tolist") else v


def _strict(v: Any) -> Any:
  """``v`` with every NaN / +-inf float (also inside lists) replaced by None: strict JSON
  (``NaN`` and ``Infinity`` are Python's extension, which other parsers refuse)."""
  if isinstance(v, float) and not math.isfinite(v):
    return None
  if isinstance(v, (list, tuple)):
    return [_strict(x) for x in v]
  return v


class JsonlCsvWriter(_ScalarWriter):
  """Appends one JSON record ``{"step": step, key: value, ...}`` per step to
  ``run_dir/metrics.jsonl`` (strict JSON: NaN / inf are written as null); ``close`` writes
  ``run_dir/metrics.csv`` (columns = the union of this run's keys, ``step`` first, then sorted;
  one row per record) and sets ``csv_path``.

  Scalars, texts and summaries (arrays, e.g. ``staleness_hist``, written as lists) written for
  the same step before ``flush`` form one record; a write for another step, ``flush`` or ``close``
  ends the record. The file is opened in append mode (``train/resume.py:truncate_jsonl`` trims
  it on resume); ``metrics.csv`` holds only this writer's records."""

  def __init__(self, run_dir: str):
    os.makedirs(run_dir, exist_ok=True)
    self.run_dir = run_dir
    self.records: list[dict] = []
    self.csv_path: Optional[str] = None
    self._pending: Optional[dict] = None
    self._jsonl = open(os.path.join(run_dir, "metrics.jsonl"), "a", encoding="utf-8")

  def _add(self, step: int, values: Mapping[str, Any]) -> None:
    if self._pending is not None and self._pending["step"] != step:
      self.flush()
    if self._pending is None:
      self._pending = {"step": step}
    self._pending.update({k: _plain(v) for k, v in values.items()})

  def write_scalars(self, step, scalars):
    self._add(step, scalars)

  def write_texts(self, step, texts):
    self._add(step, texts)

  def write_summaries(self, step, values, metadata=None):
    del metadata
    self._add(step, values)

  def flush(self):
    if self._pending is None:
      return
    rec, self._pending = self._pending, None
    self.records.append(rec)
    self._jsonl.write(json.dumps({k: _strict(v) for k, v in rec.items()}, allow_nan=False)
                      + "\n")
    self._jsonl.flush()

  def close(self):
    self.flush()
    self._jsonl.close()
    if not self.records:
      return
    keys = sorted({k for r in self.records for k in r}, key=lambda k: (k != "step", k))
    self.csv_path = os.path.join(self.run_dir, "metrics.csv")
    with open(self.csv_path, "w", newline="", encoding="utf-8") as f:
      w = csv.DictWriter(f, fieldnames=keys)
      w.writeheader()
      w.writerows(self.records)


class TensorboardXWriter(_ScalarWriter):
  """Finite scalars as TensorBoard scalars in ``logdir`` (tensorboardX event files; CLU's own
  ``SummaryWriter`` needs TensorFlow). Non-finite values are skipped (they are in metrics.jsonl)."""

  def __init__(self, logdir: str):
    from tensorboardX import SummaryWriter  # pylint: disable=import-outside-toplevel  (optional dependency)
    self._tb = SummaryWriter(logdir)

  def write_scalars(self, step, scalars):
    for k, v in scalars.items():
      if math.isfinite(v):
        self._tb.add_scalar(k, v, step)

  def flush(self):
    self._tb.flush()

  def close(self):
    self._tb.close()


class ConsoleWriter(_ScalarWriter):
  """Prints ``[<prefix or train> <step>] key value  ...`` (values ``.4g``) to ``stream`` for the
  written keys listed in ``console_keys``; nothing when none of them is written. The label is the
  part of the shown keys before their last ``/`` (``critic_warmup/``), else ``train``."""

  def __init__(self, console_keys: Sequence[str], stream=None):
    self.console_keys = tuple(console_keys)
    self.stream = stream

  def write_scalars(self, step, scalars):
    shown = [k for k in self.console_keys if k in scalars]
    if not shown:
      return
    label = os.path.commonprefix([k.rpartition("/")[0] + "/" for k in shown]).rstrip("/")
    label = label + "/" if label else "train"
    print(f"[{label} {step:4d}] " + "  ".join(f"{k} {scalars[k]:.4g}" for k in shown),
          file=self.stream or sys.stdout, flush=True)


class WandbWriter(_ScalarWriter):
  """Numeric metrics to a Weights & Biases run (files under ``run_dir``). W&B needs a monotonic
  step of its own (critic warm-up records restart at 0), so the record's step travels as the
  field ``step`` (choose it as the x-axis in the W&B UI). Raises ImportError with the fix when
  ``wandb`` is not installed (it is optional, not in requirements.txt)."""

  def __init__(self, project: str, run_dir: str, config: Optional[dict] = None):
    self._run = require_wandb().init(project=project, dir=run_dir, config=config or {},
                                     name=os.path.basename(os.path.normpath(run_dir)))

  def write_scalars(self, step, scalars):
    self._run.log({"step": step, **scalars})

  def close(self):
    if self._run is not None:
      self._run.finish()
      self._run = None


def _is_scalar(v: Any) -> bool:
  return isinstance(v, (bool, int, float, np.number)) or (hasattr(v, "item")
                                                          and np.ndim(v) == 0)


class RunWriter:
  """``log(step, metrics, prefix)`` for one run: numbers (Python, NumPy or 0-d JAX) become floats
  and go to ``write_scalars``; strings to ``write_texts``; anything else (lists, arrays) to
  ``write_summaries`` as a NumPy array; keys get ``prefix`` (``critic_warmup/``, ``final/``).
  Each ``log`` is one record (the writer is flushed after it). ``close()`` closes every writer and
  returns the ``metrics.csv`` path (None when nothing was logged or on processes other than 0).

  ``writer``: the composed ``clu.metric_writers`` writer; ``files``: its ``JsonlCsvWriter``
  (None on processes other than 0)."""

  def __init__(self, writer: interface.MetricWriter, files: Optional[JsonlCsvWriter] = None):
    self.writer = writer
    self.files = files

  def log(self, step: int, metrics: Mapping[str, Any], prefix: str = "") -> None:
    scalars, texts, arrays = {}, {}, {}
    for k, v in metrics.items():
      if _is_scalar(v):
        scalars[prefix + k] = float(v)
      elif isinstance(v, str):
        texts[prefix + k] = v
      else:
        arrays[prefix + k] = np.asarray(v)
    step = int(step)
    self.writer.write_scalars(step, scalars)
    if texts:
      self.writer.write_texts(step, texts)
    if arrays:
      self.writer.write_summaries(step, arrays)
    self.writer.flush()

  def close(self) -> Optional[str]:
    self.writer.close()
    return self.files.csv_path if self.files is not None else None


def make_metric_writer(run_dir: str, *, console_keys: Sequence[str] = (), tensorboard: bool = True,
                       stream=None, wandb_project: Optional[str] = None,
                       wandb_config: Optional[dict] = None,
                       process_index: Optional[int] = None) -> RunWriter:
  """The run's metric writer (see the module doc).

  ``run_dir``: folder of ``metrics.jsonl``/``metrics.csv`` and ``tb/`` (created on process 0).
  ``console_keys``: unprefixed metric names shown on the console line, written to ``stream``
  (default: ``sys.stdout`` at write time). ``tensorboard``: event files under ``run_dir/tb``
  (skipped if tensorboardX is not installed). ``wandb_project``: W&B project, None/"" = off.
  ``process_index``: default ``jax.process_index()``; other than 0 -> an absl-logging-only writer
  (``create_default_writer(just_logging=True)``) that writes no files and returns None on close.
  Raises ImportError with the fix when ``wandb_project`` is set and wandb is not installed."""
  if process_index is None:
    process_index = jax.process_index()
  if process_index > 0:
    return RunWriter(create_default_writer(just_logging=True, asynchronous=False))
  files = JsonlCsvWriter(run_dir)
  writers: list[interface.MetricWriter] = [files]
  if tensorboard and importlib.util.find_spec("tensorboardX") is not None:
    writers.append(TensorboardXWriter(os.path.join(run_dir, "tb")))
  if console_keys:
    writers.append(ConsoleWriter(console_keys, stream))
  if wandb_project:
    writers.append(WandbWriter(wandb_project, run_dir, wandb_config))
  return RunWriter(MultiWriter(writers), files)
