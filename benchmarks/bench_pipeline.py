"""Pipeline: the main job (``sao_jax.train.loop.run``) under ``train.mode=sao`` vs ``grpo_sync``.

    python benchmarks/bench_pipeline.py [--quick] [--json out.json] [--repeats 2]

Each run is a fresh subprocess (so its peak host memory, VmHWM, is its own), modes interleaved
(sao, grpo_sync, sao, grpo_sync, ...). The RL phase is read from the run's ``metrics.jsonl``:
RL wall = sum over steps of (``wait_s`` + ``train_s``); trajectories/s = batch * steps / RL wall;
tokens/s = sampled tokens / RL wall; trainer idle = sum(wait_s) / RL wall. Engine idle: under
``grpo_sync`` the engine is stopped at the barrier while the trainer trains, so engine idle ~
sum(train_s) / RL wall; under ``sao`` the engine only stops when the bounded queue is full
(reported: mean queue size vs capacity). Also reports jit cache sizes of the train steps at the
end of the run (1 each = no recompilation) and compile time (first step's train_s minus the
median of the rest).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import common  # pylint: disable=import-error

CHILD = r"""
import json, os, sys
sys.path.insert(0, sys.argv[1])
from configs import arith_tool
from sao_jax.train import loop, sao
caches = {}
orig = sao.SAOTrainer.__init__
def init(self, *a, **k):
  orig(self, *a, **k)
  caches["trainer"] = self
sao.SAOTrainer.__init__ = init
cfg = arith_tool.get_config("smoke")
over = json.loads(sys.argv[2])
for key, val in over.items():
  node = cfg
  parts = key.split(".")
  for p in parts[:-1]:
    node = node[p]
  node[parts[-1]] = val
summary = loop.run(cfg)
t = caches["trainer"]
def size(f):
  return f._cache_size() if hasattr(f, "_cache_size") else -1
peak = 0
for line in open("/proc/self/status"):
  if line.startswith("VmHWM"):
    peak = int(line.split()[1]) * 1024
print("BENCH_JSON " + json.dumps({"summary": {k: v for k, v in summary.items()
                                               if isinstance(v, (int, float))},
    "peak_rss": peak, "cache_policy": size(t._policy_step), "cache_critic": size(t._critic_step),
    "cache_adv": size(getattr(t, "_adv", None))}))
"""


def run_mode(mode: str, overrides: dict, run_dir: str) -> dict:
  over = dict(overrides, **{"train.mode": mode, "run_dir": run_dir})
  env = dict(os.environ, PYTHONPATH=common.ROOT)
  out = subprocess.run([sys.executable, "-c", CHILD, common.ROOT, json.dumps(over)],
                       capture_output=True, text=True, env=env, cwd=common.ROOT, check=False)
  line = [l for l in out.stdout.splitlines() if l.startswith("BENCH_JSON ")]
  if out.returncode or not line:
    raise RuntimeError(f"{mode} run failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
  rec = json.loads(line[0][len("BENCH_JSON "):])
  steps = [json.loads(l) for l in open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8")]
  steps = [s for s in steps if "wait_s" in s]
  wait = sum(s["wait_s"] for s in steps)
  train = sum(s["train_s"] for s in steps)
  rest = sorted(s["train_s"] for s in steps[1:]) or [0.0]
  tok_s = [s["tokens_per_s"] for s in steps]
  wall = wait + train
  n_traj = overrides["train.batch_size"] * len(steps)
  steady = steps[1:] or steps  # step 1 includes compilation
  s_wait = sum(s["wait_s"] for s in steady)
  s_train = sum(s["train_s"] for s in steady)
  rec.update(steady_traj_per_s=overrides["train.batch_size"] * len(steady) / (s_wait + s_train),
             steady_trainer_idle=s_wait / (s_wait + s_train),
             step_train_s_median=common.median([s["train_s"] for s in steady]),
             step_wait_s_median=common.median([s["wait_s"] for s in steady]))
  rec.update(mode=mode, steps=len(steps), rl_wall_s=wall, wait_s=wait, train_s=train,
             traj_per_s=n_traj / wall, tokens_per_s_median=common.median(tok_s),
             trainer_idle=wait / wall,
             engine_idle=(train / wall) if mode == "grpo_sync" else None,
             queue_mean=common.median([s.get("queue_size", 0) for s in steps]),
             first_step_overhead_s=steps[0]["train_s"] - rest[len(rest) // 2])
  return rec


def main():
  ap = common.parser(__doc__)
  ap.add_argument("--steps", type=int, default=12)
  ap.add_argument("--modes", default="sao,grpo_sync")
  ap.set_defaults(repeats=2)
  args = ap.parse_args()
  steps = 1 if args.quick else args.steps
  repeats = 1 if args.quick else args.repeats
  overrides = {"train.num_steps": steps, "train.batch_size": 16, "train.group_size": 8,
               "rollout.slots": 16, "sft.steps": 20, "eval.every_steps": 0,
               "checkpoint.every_steps": 0, "task.n_eval": 16, "log.tensorboard": False,
               "log.progress": "off", "rollout.max_new_tokens": 24}
  rows = []
  with tempfile.TemporaryDirectory() as d:
    for r in range(repeats):
      for mode in args.modes.split(","):
        rec = run_mode(mode, overrides, os.path.join(d, f"{mode}_{r}"))
        rows.append({k: rec[k] for k in ("mode", "steps", "rl_wall_s", "traj_per_s",
                                         "tokens_per_s_median", "trainer_idle", "engine_idle",
                                         "steady_traj_per_s", "steady_trainer_idle",
                                         "step_train_s_median", "step_wait_s_median",
                                         "queue_mean", "first_step_overhead_s")}
                    | {"peak_rss_MB": rec["peak_rss"] / 2**20,
                       "jit caches p/c/adv": f"{rec['cache_policy']}/{rec['cache_critic']}/"
                                             f"{rec['cache_adv']}"})
  steady = {m: common.median([r["steady_traj_per_s"] for r in rows if r["mode"] == m])
            for m in args.modes.split(",")}
  by = {m: common.median([r["traj_per_s"] for r in rows if r["mode"] == m])
        for m in args.modes.split(",")}
  ratio = by["sao"] / by["grpo_sync"] if len(by) == 2 else None
  common.report("pipeline", rows, args,
                {"overrides": overrides, "median_traj_per_s": by, "sao_over_sync": ratio,
                 "steady_traj_per_s": steady,
                 "steady_sao_over_sync": (steady["sao"] / steady["grpo_sync"]
                                          if len(steady) == 2 else None)})


if __name__ == "__main__":
  main()
