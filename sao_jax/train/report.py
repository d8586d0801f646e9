"""The end-of-run report: ``results.csv`` and the before/after table."""

from __future__ import annotations

import csv


def write_summary(path: str, summary: dict) -> None:
  with open(path, "w", newline="", encoding="utf-8") as f:
    w = csv.writer(f)
    w.writerow(["metric", "value"])
    for k, v in summary.items():
      w.writerow([k, v])


def print_table(summary: dict) -> None:
  b, a = summary["accuracy_before"], summary["accuracy_after"]
  rows = [("greedy accuracy", f"{100 * b:.1f}%", f"{100 * a:.1f}%", f"{100 * (a - b):+.1f} pts"),
          ("tool use", f"{100 * summary['tool_use_before']:.1f}%",
           f"{100 * summary['tool_use_after']:.1f}%",
           f"{100 * (summary['tool_use_after'] - summary['tool_use_before']):+.1f} pts")]
  print(f"\nHeld-out evaluation ({summary['eval_problems']} problems, greedy, math-verify):")
  print(f"{'':18s}{'warm start':>12s}{'after SAO':>12s}{'change':>12s}")
  for r in rows:
    print(f"{r[0]:18s}{r[1]:>12s}{r[2]:>12s}{r[3]:>12s}")
  print(f"policy steps {summary['policy_steps']}, trajectories consumed "
        f"{summary['trajectories_consumed']} / generated {summary['trajectories_generated']}, "
        f"max staleness {summary['staleness_max']:.0f}, wall {summary['wall_s']:.0f}s", flush=True)
