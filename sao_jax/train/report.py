"""The end-of-run report: ``run_dir/results.csv`` and the held-out evaluation table.

``finish(run_dir, summary)`` adds the derived fields, writes ``results.csv`` (``metric,value``
rows, read back by ``sao_jax/plot.py``) and prints the table. Derived fields:

* ``accuracy_change_pts`` = 100 * (``accuracy_after`` - ``accuracy_before``), percentage points;
* ``accuracy_dropped`` = ``accuracy_change_pts <= -DROP_THRESHOLD_PTS``. A drop is printed as a
  ``WARNING: held-out accuracy DROPPED ...`` line under the table.

Staleness-policy lengths (optional summary keys, mean action tokens per trajectory):
``response_tokens_generated_mean`` (every trajectory the rollout produced),
``response_tokens_trained_mean`` (those in a policy batch), ``response_tokens_dropped_mean``
(those the staleness policy dropped) and ``trajectories_dropped`` (count). When something was
dropped the table shows ``lengths (action tokens): generated X, trained Y, dropped Z (N dropped)``;
a trained mean below the generated one is the drop policy's bias toward short answers."""

from __future__ import annotations

import csv
import os
import sys
from typing import Optional, TextIO

# A drop of 2 points or more is flagged: 4 of arith_tool's 200 held-out problems, and any single
# problem when there are at most 50 (one of the 16 `:smoke` problems is 6.25 points). A chosen
# line, not a measured noise level: greedy evaluation on a fixed problem set is deterministic, so a
# smaller drop is real on those problems but too small to call the run broken.
DROP_THRESHOLD_PTS = 2.0

LENGTH_KEYS = ("response_tokens_generated_mean", "response_tokens_trained_mean",
               "response_tokens_dropped_mean", "trajectories_dropped")


def with_derived(summary: dict) -> dict:
  """A copy of ``summary`` with ``accuracy_change_pts`` (float, points) and ``accuracy_dropped``
  (bool, see ``DROP_THRESHOLD_PTS``) added when it has ``accuracy_before``/``accuracy_after``
  (fractions in [0, 1]). Idempotent."""
  out = dict(summary)
  if "accuracy_before" in out and "accuracy_after" in out:
    change = 100.0 * (float(out["accuracy_after"]) - float(out["accuracy_before"]))
    out["accuracy_change_pts"] = change
    out["accuracy_dropped"] = bool(change <= -DROP_THRESHOLD_PTS + 1e-9)
  return out


def write_summary(path: str, summary: dict) -> None:
  """Writes ``summary`` plus its derived fields (``with_derived``) as ``metric,value`` CSV rows."""
  with open(path, "w", newline="", encoding="utf-8") as f:
    w = csv.writer(f)
    w.writerow(["metric", "value"])
    for k, v in with_derived(summary).items():
      w.writerow([k, v])


def _tokens(v) -> str:
  return "n/a" if v is None or v != v else f"{float(v):.1f}"  # v != v: NaN


def print_table(summary: dict, stream: Optional[TextIO] = None) -> None:
  """Prints the held-out evaluation table (warm start vs after training, greedy accuracy and tool
  use, in %), the run's counters, the accuracy-drop WARNING line and the staleness-policy length
  line (module doc) to ``stream`` (default ``sys.stdout``). Needs the keys ``run`` puts in the
  summary: ``method`` (the column's name: ``SAO`` or the mode), ``accuracy_*``, ``tool_use_*``,
  ``eval_problems``, ``policy_steps``, ``trajectories_consumed``, ``trajectories_generated``,
  ``staleness_max``, ``wall_s``."""
  out = stream or sys.stdout
  s = with_derived(summary)
  b, a = s["accuracy_before"], s["accuracy_after"]
  tb, ta = s["tool_use_before"], s["tool_use_after"]
  rows = [("greedy accuracy", f"{100 * b:.1f}%", f"{100 * a:.1f}%", f"{100 * (a - b):+.1f} pts"),
          ("tool use", f"{100 * tb:.1f}%", f"{100 * ta:.1f}%", f"{100 * (ta - tb):+.1f} pts")]
  print(f"\nHeld-out evaluation ({s['eval_problems']} problems, greedy, "
        f"{s.get('grader', 'math-verify')}):", file=out)
  after = "after " + s.get("method", "SAO")
  w = max(12, len(after) + 2)  # the after column's width
  print(f"{'':18s}{'warm start':>12s}{after:>{w}s}{'change':>12s}", file=out)
  for r in rows:
    print(f"{r[0]:18s}{r[1]:>12s}{r[2]:>{w}s}{r[3]:>12s}", file=out)
  print(f"policy steps {s['policy_steps']}, trajectories consumed "
        f"{s['trajectories_consumed']} / generated {s['trajectories_generated']}, "
        f"max staleness {s['staleness_max']:.0f}, wall {s['wall_s']:.0f}s", file=out)
  if s.get("trajectories_dropped"):
    print(f"lengths (action tokens): generated {_tokens(s.get('response_tokens_generated_mean'))}, "
          f"trained {_tokens(s.get('response_tokens_trained_mean'))}, "
          f"dropped {_tokens(s.get('response_tokens_dropped_mean'))} "
          f"({int(s['trajectories_dropped'])} dropped)", file=out)
  if s["accuracy_dropped"]:
    print(f"WARNING: held-out accuracy DROPPED {100 * b:.1f}% -> {100 * a:.1f}% "
          f"({s['accuracy_change_pts']:+.1f} pts; flagged at a drop of {DROP_THRESHOLD_PTS:g} pts "
          f"or more)", file=out)
  out.flush()


def finish(run_dir: str, summary: dict, stream: Optional[TextIO] = None) -> dict:
  """``with_derived(summary)``, written to ``run_dir/results.csv`` and printed (``print_table``);
  returns it."""
  s = with_derived(summary)
  write_summary(os.path.join(run_dir, "results.csv"), s)
  print_table(s, stream)
  return s
