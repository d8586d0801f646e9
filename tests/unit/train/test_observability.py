"""Metric vocabulary, progress display, metric writing (JSONL/CSV/TensorBoard/console through CLU,
optional W&B), plot helpers and the dashboard PNG, and the generated docs being current."""

import glob
import io
import json
import os
import struct
import sys
import types

import numpy as np
import pytest

from sao_jax import docs_gen, plot
from sao_jax.train import metric_defs
from sao_jax.train.metrics import make_metric_writer
from sao_jax.train.progress import Progress, format_status


# ---- vocabulary ----------------------------------------------------------------------------------
def test_describe_strips_prefixes_and_names_the_fix():
  assert metric_defs.describe("final/eval_accuracy") is metric_defs.METRICS["eval_accuracy"]
  assert metric_defs.label("wait_s") == "wait_s [s]"
  with pytest.raises(KeyError, match="metric_defs.py"):
    metric_defs.describe("critic_warmup/no_such_metric")


# ---- progress ------------------------------------------------------------------------------------
def test_format_status_hand_values():
  assert format_status("SAO", 25, 100, 50.0, {"reward": 0.5, "rollouts": 12}) == (
      "SAO 25/100 (25%) elapsed 00:50 ETA 02:30 | reward 0.5  rollouts 12")
  assert format_status("SAO", 0, 10, 3.0, {}) == "SAO 0/10 (0%) elapsed 00:03 ETA ?"
  # the rate since step 1 (at 20 s, its compile included): 30 s for 24 steps, 75 left
  assert format_status("SAO", 25, 100, 50.0, {}, since=(1, 20.0)).endswith("ETA 01:33")
  assert format_status("SAO", 1, 100, 20.0, {}, since=(1, 20.0)).endswith("ETA ?")


class _Clock:
  def __init__(self):
    self.t = 0.0

  def __call__(self):
    return self.t


def test_progress_lines_mode_is_rate_limited_and_prints_the_last_step():
  out, clock = io.StringIO(), _Clock()  # StringIO is not a TTY -> "auto" picks lines
  p = Progress(4, desc="steps", stream=out, min_interval_s=10.0, clock=clock)
  assert p.mode == "lines" and p.stream is out
  for t in (1.0, 5.0, 12.0, 13.0):
    clock.t = t
    p.update(reward=0.25, staleness=1.5)
  p.close()
  lines = out.getvalue().splitlines()
  # step 1 (first), step 3 (11 s after step 1), step 4 (last); step 2 is within 10 s
  assert [l.split()[1] for l in lines] == ["1/4", "3/4", "4/4"]
  assert lines[0].endswith("ETA ? | reward 0.25  staleness 1.5")  # step 1 only: no rate yet
  assert "elapsed 00:12 ETA 00:05 |" in lines[1]  # (12 - 1) s / 2 steps x 1 left
  assert lines[-1] == "steps 4/4 (100%) elapsed 00:13 ETA 00:00 | reward 0.25  staleness 1.5"
  assert "\r" not in out.getvalue()


def test_progress_bar_mode_keeps_other_lines_intact():
  out = io.StringIO()
  p = Progress(2, desc="steps", mode="bar", stream=out)
  print("[train    1] reward_mean 0.5", file=p.stream)
  p.update(reward=0.5)
  p.update(reward=0.75)
  p.close()
  text = out.getvalue()
  assert "[train    1] reward_mean 0.5\n" in text and "2/2" in text and "reward 0.75" in text
  with pytest.raises(ValueError, match="log.progress"):
    Progress(2, mode="fancy")


# ---- metric writer (clu.metric_writers) ---------------------------------------------------------
def _tb_scalars(logdir):
  """``{(tag, step): value}`` of every scalar in the tensorboardX event files under ``logdir``
  (TFRecord framing: u64 length, u32 crc, Event proto, u32 crc)."""
  from tensorboardX.proto.event_pb2 import Event  # pylint: disable=import-outside-toplevel
  out = {}
  for path in glob.glob(os.path.join(logdir, "events.out.tfevents.*")):
    data = open(path, "rb").read()
    i = 0
    while i < len(data):
      (n,) = struct.unpack("<Q", data[i:i + 8])
      ev = Event.FromString(data[i + 12:i + 12 + n])
      i += 12 + n + 4
      for v in ev.summary.value:
        out[(v.tag, ev.step)] = v.simple_value
  return out


def _log_three_records(w):
  w.log(0, {"value_loss": 1.5}, prefix="critic_warmup/")
  w.log(1, {"reward_mean": np.float32(0.5), "staleness_hist": [3, 1], "rollouts": 3,
            "x": float("nan"), "value_loss": 0.25})
  w.log(1, {"eval_accuracy": 0.25}, prefix="final/")
  return w.close()


def test_metric_writer_files_match_the_former_logger(tmp_path):
  out = io.StringIO()
  w = make_metric_writer(str(tmp_path), console_keys=("reward_mean", "value_loss"), stream=out,
                         process_index=0)
  csv_path = _log_three_records(w)
  # the records (and metrics.csv text) the hand-written MetricLogger of a136f52 wrote for these
  # calls (JSONL key order aside: lists now come after the numbers in a record)
  def strict(name):  # NaN / Infinity are not JSON: a strict parser refuses them
    raise ValueError(f"{name} in metrics.jsonl")
  recs = [json.loads(l, parse_constant=strict)
          for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert recs[1].pop("x") is None  # NaN -> null (metrics.csv keeps nan)
  assert recs == [{"step": 0, "critic_warmup/value_loss": 1.5},
                  {"step": 1, "reward_mean": 0.5, "staleness_hist": [3, 1], "rollouts": 3.0,
                   "value_loss": 0.25},
                  {"step": 1, "final/eval_accuracy": 0.25}]
  assert csv_path == str(tmp_path / "metrics.csv")
  assert (tmp_path / "metrics.csv").read_text().splitlines() == [
      "step,critic_warmup/value_loss,final/eval_accuracy,reward_mean,rollouts,staleness_hist,"
      "value_loss,x",
      "0,1.5,,,,,,", '1,,,0.5,3.0,"[3, 1]",0.25,nan', "1,,0.25,,,,,"]
  assert out.getvalue() == "[train    1] reward_mean 0.5  value_loss 0.25\n"
  # TensorBoard: finite scalars only (NaN "x" and the list are not scalars there)
  assert _tb_scalars(str(tmp_path / "tb")) == {
      ("critic_warmup/value_loss", 0): 1.5, ("reward_mean", 1): 0.5, ("rollouts", 1): 3.0,
      ("value_loss", 1): 0.25, ("final/eval_accuracy", 1): 0.25}
  # a second writer on the same folder appends (resume.truncate_jsonl trims on resume)
  w2 = make_metric_writer(str(tmp_path), tensorboard=False, process_index=0)
  w2.log(2, {"reward_mean": 1.0})
  assert w2.close() == csv_path
  assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 4
  assert (tmp_path / "metrics.csv").read_text().splitlines() == ["step,reward_mean", "2,1.0"]


def test_metric_writer_labels_prefixed_console_keys_and_nothing_logged_gives_no_csv(tmp_path):
  out = io.StringIO()
  w = make_metric_writer(str(tmp_path), console_keys=("critic_warmup/value_loss",), stream=out,
                         tensorboard=False, process_index=0)
  w.log(3, {"value_loss": 0.123456}, prefix="critic_warmup/")
  w.log(4, {"reward_mean": 1.0})
  w.close()
  assert out.getvalue() == "[critic_warmup/    3] critic_warmup/value_loss 0.1235\n"
  assert make_metric_writer(str(tmp_path / "empty"), process_index=0).close() is None


def test_metric_writer_on_other_processes_writes_no_files(tmp_path):
  out = io.StringIO()
  run_dir = tmp_path / "run"
  w = make_metric_writer(str(run_dir), console_keys=("reward_mean",), stream=out,
                         wandb_project="never-initialised", process_index=1)
  w.log(1, {"reward_mean": 0.5, "staleness_hist": [3, 1]})
  assert w.close() is None
  assert not run_dir.exists() and out.getvalue() == ""


# ---- W&B -----------------------------------------------------------------------------------------
def test_metric_logger_sends_numeric_metrics_to_wandb(tmp_path, monkeypatch):
  calls = []

  class _Run:
    def log(self, data):
      calls.append(("log", data))

    def finish(self):
      calls.append(("finish",))

  fake = types.ModuleType("wandb")
  fake.init = lambda **kw: calls.append(("init", kw["project"])) or _Run()
  monkeypatch.setitem(sys.modules, "wandb", fake)
  log = make_metric_writer(str(tmp_path), tensorboard=False, stream=io.StringIO(),
                           wandb_project="sao-test", process_index=0)
  log.log(1, {"reward_mean": 0.5, "staleness_hist": [3, 1]})
  log.close()
  assert calls == [("init", "sao-test"), ("log", {"step": 1, "reward_mean": 0.5}), ("finish",)]
  rec = json.loads((tmp_path / "metrics.jsonl").read_text())
  assert rec == {"step": 1, "reward_mean": 0.5, "staleness_hist": [3, 1]}


def test_metric_logger_says_how_to_get_wandb(tmp_path, monkeypatch):
  monkeypatch.setitem(sys.modules, "wandb", None)  # import fails
  with pytest.raises(ImportError, match="pip install wandb"):
    make_metric_writer(str(tmp_path), tensorboard=False, wandb_project="x", process_index=0)


# ---- plot helpers --------------------------------------------------------------------------------
def test_plot_helpers_hand_values():
  recs = [{"step": 1, "reward_mean": 0.0, "staleness_hist": [4]},
          {"step": 2, "reward_mean": float("nan"), "staleness_hist": [1, 2, 3]},
          {"step": 3, "reward_mean": 1.0, "staleness_hist": [0, 1]},
          {"step": 3, "final/eval_accuracy": 0.5}]
  s, v = plot.series(recs, "reward_mean")
  assert s.tolist() == [1, 3] and v.tolist() == [0.0, 1.0]  # NaN dropped
  assert plot.staleness_histogram(recs).tolist() == [5, 3, 3]
  assert plot.moving_average(np.array([1.0, 3.0, 5.0, 7.0]), 2).tolist() == [1.0, 2.0, 4.0, 6.0]
  # a second run appended to the same file: only its records are kept
  appended = recs + [{"step": 0, "critic_warmup/value_loss": 1.0}, {"step": 1, "reward_mean": 0.2}]
  assert plot.last_run(appended) == appended[-2:]
  assert plot.last_run(recs) == recs


def _synthetic_run(run_dir, steps=30):
  rng = np.random.default_rng(0)
  with open(run_dir / "metrics.jsonl", "w") as f:
    for s in range(1, steps + 1):
      rec = {"step": s, "reward_mean": min(1.0, s / steps + 0.1 * rng.standard_normal()),
             "explained_variance": 0.6 * (1 - np.exp(-s / 8)), "value_loss": 0.2 * np.exp(-s / 10),
             "masked_fraction": 0.006, "masked_fraction_low": 0.004, "masked_fraction_high": 0.002,
             "staleness_hist": [50, 30, 10], "staleness_max": 2.0, "tokens_per_s": 900.0 + s,
             "wait_s": 0.5, "train_s": 1.0}
      if s % 10 == 0:
        rec["eval_accuracy"] = s / steps
      f.write(json.dumps(rec) + "\n")
    f.write(json.dumps({"step": steps, "final/eval_accuracy": 0.95}) + "\n")
  (run_dir / "results.csv").write_text("metric,value\naccuracy_before,0.03\naccuracy_after,0.95\n")


@pytest.mark.slow
def test_dashboard_png_is_written(tmp_path):
  _synthetic_run(tmp_path)
  assert plot.main([str(tmp_path)]) == 0
  from PIL import Image  # pylint: disable=import-outside-toplevel
  img = Image.open(tmp_path / "plots" / "dashboard.png")
  assert img.size == (1500, 1300)
  assert np.asarray(img.convert("L")).std() > 20  # not a blank canvas
  assert plot.main([str(tmp_path / "missing")]) == 2


# ---- docs ----------------------------------------------------------------------------------------
def test_generated_docs_are_current_and_every_config_field_is_documented():
  assert docs_gen.main(["--check"]) == 0, "run `python -m sao_jax.docs_gen`"
  text = docs_gen.render_config_docs()
  rows = [l for l in text.splitlines() if l.startswith("| `")]
  assert len(rows) > 80
  undocumented = [r for r in rows if r.rstrip().endswith("|  |")]
  assert not undocumented, undocumented
  assert "| `train.eps_low` | `0.3` | `[0,1)` | DIS band" in text  # from sao_jax/roles.py
  assert "| `task.name` | `'arith_tool'` | `'arith_tool'`, `'chain_tool'`" in text
  assert "**Variant `configs/arith_tool.py:smoke`** changes:" in text


def test_field_comments_parser(tmp_path):
  p = tmp_path / "c.py"
  p.write_text('  c.a.b = "x#y"  # the comment\n  c.d = 1\n  c.a.b = 2  # variant override\n')
  assert docs_gen.field_comments(str(p)) == {"a.b": "the comment"}
