"""Soak test (not in CI): runs the main job for --minutes, SIGKILLs the driver again and again
(and restarts it, so it resumes), with injected environment faults (exceptions, hangs, NaN
rewards at --env_fault_rate), then checks that no state was lost and memory stayed bounded.

    python scripts/soak.py --minutes 20 --run_dir /tmp/sao_soak
    python scripts/soak.py --minutes 20 --run_dir runs/soak_ray --backend ray

Driver kills: each incarnation is killed at a fault-injection point (``SAO_FAULT_KILL``, see
``sao_jax/faults.py``), the points taken in turn -- ``rollout`` (half a batch collected),
``train`` (after the update, before publish / save), ``checkpoint`` (right after an asynchronous
save started) -- two to ten steps after the checkpoint it resumes from; a seeded random
0.5-1.5 x --kill_every_s seconds timer is the backstop (kind ``timer``: set it well above an
incarnation's start-up, or the timer takes most kills). With ``--backend ray``
(two rollout actors on a local Ray) a random actor process is also SIGKILLed every
0.5-1.5 x --actor_kill_every_s seconds (Ray restarts it), and the Ray a killed driver leaves
behind is stopped before the next incarnation (each gets its own ``RAY_TMPDIR``).

Every incarnation shares one JAX compilation cache (``<run_dir>_jax_cache``) and the SFT warm
start (``<run_dir>_sft_cache``). Checks at the end: ledger steps are 1..N with no gaps or
repeats, every prompt position was consumed exactly once, the checkpoint's cursor agrees with
the ledger, kills by kind, and each incarnation's peak RSS (the driver's). Prints a JSON summary
(also written to <run_dir>/soak_summary.json).
"""

import argparse
import collections
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
POINTS = ("rollout", "train", "checkpoint")


def rss_mb(pid):
  try:
    with open(f"/proc/{pid}/status") as f:
      for line in f:
        if line.startswith("VmRSS:"):
          return int(line.split()[1]) / 1024
  except OSError:
    return None
  return None


def _cmdline(pid: str) -> bytes:
  try:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
      return f.read()
  except OSError:
    return b""


def ray_pids(ray_dir: str) -> list[int]:
  """Processes of the Ray whose temp dir is ``ray_dir`` (raylet, GCS, agents: their command
  lines name it) and Ray workers (``ray::...`` titles) whose parent is one of them."""
  procs = {p: _cmdline(p) for p in os.listdir("/proc") if p.isdigit()}
  mine = {int(p) for p, c in procs.items() if ray_dir.encode() in c}
  for p, c in procs.items():
    try:
      with open(f"/proc/{p}/stat", "rb") as f:
        ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
      continue
    if ppid in mine and c.startswith(b"ray::"):
      mine.add(int(p))
  return sorted(mine)


def actor_pids(ray_dir: str) -> list[int]:
  """The rollout actors' processes of that Ray."""
  return [p for p in ray_pids(ray_dir) if _cmdline(str(p)).startswith(b"ray::RolloutActor")]


def last_checkpoint(run_dir: str) -> int:
  """Newest complete checkpoint step (folder named by its step), 0 if none."""
  d = os.path.join(run_dir, "checkpoints")
  steps = [int(n) for n in os.listdir(d) if n.isdigit()] if os.path.isdir(d) else []
  return max(steps, default=0)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--minutes", type=float, default=20)
  ap.add_argument("--kill_every_s", type=float, default=90,
                  help="backstop timer of a driver incarnation")
  ap.add_argument("--env_fault_rate", type=float, default=0.02)
  ap.add_argument("--run_dir", default="/tmp/sao_soak")
  ap.add_argument("--seed", type=int, default=0, help="seed of the kill times and points")
  ap.add_argument("--backend", choices=("thread", "ray"), default="thread")
  ap.add_argument("--actor_kill_every_s", type=float, default=25,
                  help="--backend ray: mean seconds between SIGKILLs of a rollout actor")
  ap.add_argument("--no_kill_points", action="store_true",
                  help="kill the driver by the timer only (the former behaviour)")
  ap.add_argument("--extra", nargs="*", default=[])
  a = ap.parse_args()
  args = [sys.executable, "-m", "sao_jax.main", "--config=configs/arith_tool.py:smoke",
          f"--config.run_dir={a.run_dir}", "--config.train.num_steps=100000",
          f"--config.sft.cache_dir={a.run_dir}_sft_cache",  # a restart before the first
          # checkpoint reuses the warm start instead of retraining it (and being killed again)
          "--config.checkpoint.every_steps=2", "--config.eval.every_steps=0",
          "--config.log.tensorboard=False", "--config.rollout.env_timeout_s=2.0",
          # no critic warm-up: its batches would enter ledger.jsonl as step 1 too (the ledger
          # labels a batch policy_version + 1), and the check below wants 1..N once each
          "--config.train.critic_warmup_steps=0"]
  if a.backend == "ray":
    args += ["--config.rollout.backend=ray", "--config.rollout.num_workers=2",
             "--config.rollout.ray_num_cpus=0.5", "--config.rollout.ray_max_restarts=1000"]
  args += a.extra
  env = dict(os.environ, SAO_FAULT_ENV_RATE=str(a.env_fault_rate), PYTHONUNBUFFERED="1",
             # one compilation cache for every incarnation: a restart compiles nothing again
             JAX_COMPILATION_CACHE_DIR=a.run_dir + "_jax_cache",
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
             JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
  env.pop("SAO_FAULT_KILL", None)
  t_end = time.time() + 60 * a.minutes
  incarnations = []
  os.makedirs(os.path.dirname(os.path.abspath(a.run_dir)), exist_ok=True)
  log_path = a.run_dir + "_soak.log"
  log = open(log_path, "a")
  rng = random.Random(a.seed)
  while time.time() < t_end:
    point = None if a.no_kill_points else POINTS[len(incarnations) % len(POINTS)]
    done = last_checkpoint(a.run_dir)  # the step this incarnation resumes from
    # a save happens every 2 steps (checkpoint.every_steps): the checkpoint point needs one
    at = (done - done % 2 + 2 * rng.randint(1, 5) if point == "checkpoint"
          else done + rng.randint(2, 10))
    inc_env = dict(env, SAO_FAULT_KILL=f"{point}:{at}") if point else dict(env)
    ray_dir = tempfile.mkdtemp(prefix="sao_soak_ray_", dir="/tmp")  # short: unix sockets
    inc_env["RAY_TMPDIR"] = ray_dir
    log.flush()
    start = os.path.getsize(log_path)  # the child appends through its own descriptor
    proc = subprocess.Popen(args, cwd=ROOT, env=inc_env, stdout=log, stderr=subprocess.STDOUT)
    t0, peak, samples, actor_kills = time.time(), 0.0, [], 0
    # backstop: SIGKILL after a uniform [0.5, 1.5] x kill_every_s (seeded)
    life = rng.uniform(0.5, 1.5) * a.kill_every_s
    next_actor_kill = t0 + rng.uniform(0.5, 1.5) * a.actor_kill_every_s
    while proc.poll() is None and time.time() - t0 < life and time.time() < t_end:
      r = rss_mb(proc.pid)
      if r:
        peak = max(peak, r)
        samples.append(round(r))
      if a.backend == "ray" and time.time() >= next_actor_kill:
        actors = actor_pids(ray_dir)
        if actors:
          try:
            os.kill(rng.choice(actors), signal.SIGKILL)
            actor_kills += 1
          except ProcessLookupError:
            pass
        next_actor_kill = time.time() + rng.uniform(0.5, 1.5) * a.actor_kill_every_s
      time.sleep(1)
    timer = proc.poll() is None
    ended = timer and time.time() >= t_end  # the soak's time is up: not a kill that counts
    if timer:
      proc.send_signal(signal.SIGKILL)
    proc.wait()
    leftover = ray_pids(ray_dir)  # a SIGKILLed driver cannot stop the Ray it started
    for pid in leftover:
      try:
        os.kill(pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
    shutil.rmtree(ray_dir, ignore_errors=True)
    with open(log_path, "rb") as f:
      f.seek(start)
      out = f.read().decode(errors="replace")
    injected = f"fault injection: SIGKILL at {point} of step {at}" in out if point else False
    kind = point if injected else ("end" if ended else "timer" if timer else None)
    incarnations.append({"seconds": round(time.time() - t0), "peak_rss_mb": round(peak),
                         "killed": kind, "planned": f"{point}:{at}" if point else None,
                         "returncode": proc.returncode, "actor_kills": actor_kills,
                         "ray_processes_left": len(leftover),
                         "rss_last_mb": samples[-1] if samples else None})
    print(json.dumps(incarnations[-1]), flush=True)
  def jsonl(name):  # absent when no incarnation got that far
    path = os.path.join(a.run_dir, name)
    return [json.loads(l) for l in open(path)] if os.path.exists(path) else []
  ledger = jsonl("ledger.jsonl")
  steps = [r["step"] for r in ledger if r["step"] > 0]
  positions = [p for r in ledger for p in r["positions"]]
  sys.path.insert(0, ROOT)
  meta = {}
  if last_checkpoint(a.run_dir):
    from sao_jax.train.checkpoint import Checkpointer  # pylint: disable=import-outside-toplevel
    ck = Checkpointer(os.path.join(a.run_dir, "checkpoints"))
    meta = ck.meta()
    ck.close()
  metrics = jsonl("metrics.jsonl")
  train = [m for m in metrics if "policy_loss" in m]
  upto = [p for r in ledger if 0 < r["step"] <= meta.get("step", 0) for p in r["positions"]]
  kinds = collections.Counter(i["killed"] for i in incarnations
                              if i["killed"] not in (None, "end"))
  summary = {
      "backend": a.backend, "minutes": a.minutes, "incarnations": len(incarnations),
      "kills": sum(kinds.values()), "kills_by_kind": dict(kinds),
      "actor_kills": sum(i["actor_kills"] for i in incarnations),
      "crashes_other": sum((not i["killed"]) and i["returncode"] != 0 for i in incarnations),
      "stopped_at_end": sum(i["killed"] == "end" for i in incarnations),
      "steps_logged": len(steps), "steps_contiguous": steps == list(range(1, len(steps) + 1)),
      "positions_unique": len(positions) == len(set(positions)),
      "prompts_consumed": len(positions),
      "checkpoint_step": meta.get("step"),
      "checkpoint_cursor_matches_ledger": set(upto) == (
          set(range(meta.get("ledger", {}).get("low", 0)))
          | set(meta.get("ledger", {}).get("extra", []))),
      "env_errors_last_incarnation": max((m.get("env_errors_total", 0) or 0 for m in train),
                                         default=0),
      "failed_trajectories_total": sum(m.get("failed", 0) or 0 for m in train),
      "peak_rss_mb_per_incarnation": [i["peak_rss_mb"] for i in incarnations],
  }
  print(json.dumps(summary, indent=1))
  with open(os.path.join(a.run_dir, "soak_summary.json"), "w") as f:
    json.dump({"summary": summary, "incarnations": incarnations}, f, indent=1)


if __name__ == "__main__":
  main()
