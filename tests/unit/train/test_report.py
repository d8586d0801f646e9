"""End-of-run report: results.csv rows, the table, the accuracy-drop flag, the length line."""

import csv
import io

from sao_jax import plot
from sao_jax.train import report


def _summary(before, after, **extra):
  s = {"accuracy_before": before, "accuracy_after": after, "tool_use_before": 0.5,
       "tool_use_after": 0.75, "eval_problems": 4, "policy_steps": 3,
       "trajectories_consumed": 24, "trajectories_generated": 30, "staleness_max": 2.0,
       "wall_s": 12.3, "metrics_csv": None}
  s.update(extra)
  return s


def _results(run_dir):
  with open(run_dir / "results.csv", encoding="utf-8") as f:
    return dict(list(csv.reader(f))[1:])


def test_accuracy_drop_is_flagged_in_the_table_and_results_csv(tmp_path):
  out = io.StringIO()
  s = report.finish(str(tmp_path), _summary(0.5, 0.25), stream=out)
  text = out.getvalue()
  assert "WARNING: held-out accuracy DROPPED 50.0% -> 25.0% (-25.0 pts" in text
  assert "greedy accuracy          50.0%       25.0%   -25.0 pts" in text
  assert s["accuracy_dropped"] is True and s["accuracy_change_pts"] == -25.0
  rows = _results(tmp_path)
  assert rows["accuracy_dropped"] == "True" and float(rows["accuracy_change_pts"]) == -25.0
  # pylint: disable-next=protected-access
  assert plot._results(str(tmp_path))["accuracy_dropped"] == "True"


def test_improvement_is_not_flagged(tmp_path):
  out = io.StringIO()
  report.finish(str(tmp_path), _summary(0.25, 0.5), stream=out)
  assert "WARNING" not in out.getvalue() and "DROPPED" not in out.getvalue()
  assert "greedy accuracy          25.0%       50.0%   +25.0 pts" in out.getvalue()
  assert "  warm start   after SAO" in out.getvalue()  # no method given: SAO
  rows = _results(tmp_path)
  assert rows["accuracy_dropped"] == "False" and float(rows["accuracy_change_pts"]) == 25.0


def test_the_table_names_the_method_that_trained(tmp_path):
  out = io.StringIO()
  report.finish(str(tmp_path), _summary(0.25, 0.5, method="grpo_async"), stream=out)
  text = out.getvalue()
  assert "  warm start  after grpo_async      change" in text and "SAO" not in text
  assert "greedy accuracy          25.0%             50.0%   +25.0 pts" in text
  assert _results(tmp_path)["method"] == "grpo_async"


def test_drop_threshold_edges():
  # 2.0 pts is the line: 80.0% -> 78.0% flagged, 80.0% -> 78.5% (1.5 pts) not, equal not
  assert report.with_derived(_summary(0.80, 0.78))["accuracy_dropped"] is True
  assert report.with_derived(_summary(0.80, 0.785))["accuracy_dropped"] is False
  assert report.with_derived(_summary(0.5, 0.5))["accuracy_dropped"] is False


def test_length_line_when_the_drop_policy_dropped_something(tmp_path):
  out = io.StringIO()
  lengths = {"response_tokens_generated_mean": 41.25, "response_tokens_trained_mean": 30.0,
             "response_tokens_dropped_mean": 75.0, "trajectories_dropped": 6}
  report.finish(str(tmp_path), _summary(0.25, 0.5, **lengths), stream=out)
  assert ("lengths (action tokens): generated 41.2, trained 30.0, dropped 75.0 (6 dropped)"
          in out.getvalue())
  rows = _results(tmp_path)
  assert {k: float(rows[k]) for k in lengths} == lengths
  # nothing dropped: no length line, the numbers still in results.csv
  out = io.StringIO()
  report.finish(str(tmp_path), _summary(0.25, 0.5, response_tokens_generated_mean=30.0,
                                        response_tokens_trained_mean=30.0,
                                        response_tokens_dropped_mean=float("nan"),
                                        trajectories_dropped=0), stream=out)
  assert "lengths" not in out.getvalue()
  assert _results(tmp_path)["trajectories_dropped"] == "0"
