"""Soak test (not in CI): runs the main job for --minutes, SIGKILLs it after a random
0.5-1.5 x --kill_every_s seconds (and restarts it, so it resumes), with injected environment faults (exceptions, hangs,
NaN rewards at --env_fault_rate), then checks that no state was lost and memory stayed bounded.

    python scripts/soak.py --minutes 20 --run_dir /tmp/sao_soak

Checks at the end: ledger steps are 1..N with no gaps or repeats, every prompt position was
consumed exactly once, the checkpoint's cursor agrees with the ledger, and each incarnation's
peak RSS. Prints a JSON summary (also written to <run_dir>/soak_summary.json).
"""

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rss_mb(pid):
  try:
    with open(f"/proc/{pid}/status") as f:
      for line in f:
        if line.startswith("VmRSS:"):
          return int(line.split()[1]) / 1024
  except OSError:
    return None
  return None


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--minutes", type=float, default=20)
  ap.add_argument("--kill_every_s", type=float, default=60)
  ap.add_argument("--env_fault_rate", type=float, default=0.02)
  ap.add_argument("--run_dir", default="/tmp/sao_soak")
  ap.add_argument("--seed", type=int, default=0, help="seed of the kill times")
  ap.add_argument("--extra", nargs="*", default=[])
  a = ap.parse_args()
  args = [sys.executable, "-m", "sao_jax.main", "--config=configs/arith_tool.py:smoke",
          f"--config.run_dir={a.run_dir}", "--config.train.num_steps=100000",
          f"--config.sft.cache_dir={a.run_dir}_sft_cache",  # a restart before the first
          # checkpoint reuses the warm start instead of retraining it (and being killed again)
          "--config.checkpoint.every_steps=2", "--config.eval.every_steps=0",
          "--config.log.tensorboard=False", "--config.rollout.env_timeout_s=2.0", *a.extra]
  env = dict(os.environ, SAO_FAULT_ENV_RATE=str(a.env_fault_rate), PYTHONUNBUFFERED="1")
  t_end = time.time() + 60 * a.minutes
  incarnations = []
  log = open(os.path.join(a.run_dir + "_soak.log"), "a")
  rng = random.Random(a.seed)
  while time.time() < t_end:
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    t0, peak, samples = time.time(), 0.0, []
    # SIGKILL after a uniform [0.5, 1.5] x kill_every_s (seeded): kills land at different points
    # of the step (rollout, train step, checkpoint save) instead of in phase with them
    life = rng.uniform(0.5, 1.5) * a.kill_every_s
    while proc.poll() is None and time.time() - t0 < life and time.time() < t_end:
      r = rss_mb(proc.pid)
      if r:
        peak = max(peak, r)
        samples.append(round(r))
      time.sleep(2)
    killed = proc.poll() is None
    if killed:
      proc.send_signal(signal.SIGKILL)
    proc.wait()
    incarnations.append({"seconds": round(time.time() - t0), "peak_rss_mb": round(peak),
                         "killed": killed, "returncode": proc.returncode,
                         "rss_last_mb": samples[-1] if samples else None})
    print(json.dumps(incarnations[-1]), flush=True)
  ledger = [json.loads(l) for l in open(os.path.join(a.run_dir, "ledger.jsonl"))]
  steps = [r["step"] for r in ledger if r["step"] > 0]
  positions = [p for r in ledger for p in r["positions"]]
  sys.path.insert(0, ROOT)
  from sao_jax.train.checkpoint import Checkpointer  # pylint: disable=import-outside-toplevel
  ck = Checkpointer(os.path.join(a.run_dir, "checkpoints"))
  meta = ck.meta()
  ck.close()
  metrics = [json.loads(l) for l in open(os.path.join(a.run_dir, "metrics.jsonl"))]
  train = [m for m in metrics if "policy_loss" in m]
  upto = [p for r in ledger if 0 < r["step"] <= meta.get("step", 0) for p in r["positions"]]
  summary = {
      "minutes": a.minutes, "incarnations": len(incarnations),
      "kills": sum(i["killed"] for i in incarnations),
      "crashes_other": sum((not i["killed"]) and i["returncode"] != 0 for i in incarnations),
      "steps_logged": len(steps), "steps_contiguous": steps == list(range(1, len(steps) + 1)),
      "positions_unique": len(positions) == len(set(positions)),
      "checkpoint_step": meta.get("step"),
      "checkpoint_cursor_matches_ledger": set(upto) == (
          set(range(meta.get("ledger", {}).get("low", 0))) | set(meta.get("ledger", {}).get("extra", []))),
      "env_errors_last_incarnation": max((m.get("env_errors_total", 0) for m in train), default=0),
      "failed_trajectories_total": sum(m.get("failed", 0) for m in train),
      "peak_rss_mb_per_incarnation": [i["peak_rss_mb"] for i in incarnations],
  }
  print(json.dumps(summary, indent=1))
  with open(os.path.join(a.run_dir, "soak_summary.json"), "w") as f:
    json.dump({"summary": summary, "incarnations": incarnations}, f, indent=1)


if __name__ == "__main__":
  main()
