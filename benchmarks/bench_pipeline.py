"""Pipeline: the main job (``sao_jax.train.loop.run``) under ``train.mode=sao`` vs ``grpo_sync``.

    python benchmarks/bench_pipeline.py [--quick] [--json out.json] [--repeats 2]
        [--config chain_tool] [--tool_latency lognormal:MEDIAN_S:SIGMA]
        [--backend ray --num_workers 2]

Each run is a fresh subprocess (so its peak host memory, VmHWM, is its own), modes interleaved
(sao, grpo_sync, sao, grpo_sync, ...), same batch (16), slots (16) and everything else. The RL
phase is read from the run's ``metrics.jsonl``: RL wall = sum over steps of (``wait_s`` +
``train_s``); trajectories/s = batch * steps / RL wall; tokens/s = median over steps of the engine's
sampled tokens per second of wall (``tokens_per_s``);
trainer idle = sum(wait_s) / RL wall. Engine, from the rollout worker's own counters
(``rollout_*`` metrics): engine busy = time in generate() + prefill() / wall; engine idle = time
the worker had nothing to run / wall = nothing to admit (the grpo_sync barrier) + every running
slot waiting on its tool call + blocked on the full queue (SAO's backpressure), each also
reported; slot occupancy = decoding slots / slots over the generate steps; staleness = mean over
steps of the batch's ``staleness_mean`` (versions); engine traj/s =
trajectories the worker finished per second (throttled by a full queue). "steady" = steps 2..N
(step 1 includes compilation). Also reports jit cache sizes of the train steps at the end of the
run (1 each = no recompilation) and compile time (first step's train_s minus the median of the
rest).

``--tool_latency lognormal:M:S`` is the long-tailed task: every calculator call sleeps a seeded
lognormal time with median M s and log-std S (``task.tool_latency_median_s`` / ``_sigma``,
``sao_jax/envs/arith_tool.py``); env.step then runs on ``rollout.slots`` threads in both modes
(``rollout.env_workers`` auto), so a slow call stalls only its own slot.

``--backend ray --num_workers N`` runs the rollouts in N Ray actors (``rollout.backend=ray``);
the engine counters (``rollout_*``) live in the actors then, so the engine columns read 0 and
only the trainer-side columns (trajectories/s, trainer idle) are measured.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile

import common  # pylint: disable=import-error

CHILD = r"""
import json, os, sys
sys.path.insert(0, sys.argv[1])
from sao_jax import configs
from sao_jax.train import learner, loop
caches = {}
orig = learner.Learner.__init__
def init(self, *a, **k):
  orig(self, *a, **k)
  caches["trainer"] = self
learner.Learner.__init__ = init
over = json.loads(sys.argv[2])
cfg = configs.load(over.pop("config"), "smoke")
for key, val in over.items():
  node = cfg
  parts = key.split(".")
  for p in parts[:-1]:
    node = node[p]
  node[parts[-1]] = val
summary = loop.run(cfg)
t = caches["trainer"]
compiles = t.compilations()
peak = 0
for line in open("/proc/self/status"):
  if line.startswith("VmHWM"):
    peak = int(line.split()[1]) * 1024
print("BENCH_JSON " + json.dumps({"summary": {k: v for k, v in summary.items()
                                               if isinstance(v, (int, float))},
    "peak_rss": peak, "cache_policy": compiles.get("policy", -1),
    "cache_critic": compiles.get("critic", -1), "cache_adv": compiles.get("targets", -1)}))
"""


def parse_tool_latency(text: str) -> tuple[float, float]:
  """``"lognormal:0.2:1.0"`` -> (median_s 0.2, sigma 1.0); ``""`` or ``"0"`` -> (0.0, 1.0) (off).

  Raises ValueError for any other form or negative numbers."""
  if text in ("", "0", "off"):
    return 0.0, 1.0
  parts = text.split(":")
  if len(parts) != 3 or parts[0] != "lognormal":
    raise ValueError(f"--tool_latency {text!r}: use lognormal:MEDIAN_S:SIGMA, e.g. "
                     "lognormal:0.2:1.0")
  median, sigma = float(parts[1]), float(parts[2])
  if median < 0 or sigma < 0:
    raise ValueError(f"--tool_latency {text!r}: median and sigma must be >= 0")
  return median, sigma


def run_mode(mode: str, overrides: dict, run_dir: str) -> dict:
  """Runs the main job once in a subprocess; returns its throughput / idle record (module doc)."""
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
  batch = overrides["train.batch_size"]
  wait = sum(s["wait_s"] for s in steps)
  train = sum(s["train_s"] for s in steps)
  rest = sorted(s["train_s"] for s in steps[1:]) or [0.0]
  tok_s = [s["tokens_per_s"] for s in steps]
  wall = wait + train
  n_traj = batch * len(steps)
  steady = steps[1:] or steps  # step 1 includes compilation
  s_wait = sum(s["wait_s"] for s in steady)
  s_train = sum(s["train_s"] for s in steady)

  def engine(first, last, span):
    """Engine fractions between two cumulative records (first None = the worker's start)."""
    def d(key):
      return last.get(key, 0.0) - (first.get(key, 0.0) if first else 0.0)
    busy = d("rollout_generate_s") + d("rollout_prefill_s")
    gen_steps = d("rollout_generate_steps")
    occ_last = last.get("rollout_slot_occupancy", 0.0) * last.get("rollout_generate_steps", 0)
    occ_first = (first.get("rollout_slot_occupancy", 0.0) * first.get("rollout_generate_steps", 0)
                 if first else 0.0)
    return {"engine_busy": busy / span,
            "engine_idle": (d("rollout_idle_s") + d("rollout_env_wait_s") + d("rollout_sink_s"))
                           / span,
            "engine_idle_barrier": d("rollout_idle_s") / span,
            "engine_idle_tools": d("rollout_env_wait_s") / span,
            "engine_idle_queue_full": d("rollout_sink_s") / span,
            "slot_occupancy": (occ_last - occ_first) / max(1.0, gen_steps),
            "engine_traj_per_s": d("rollout_trajectories") / span}

  last = steps[-1]
  rec.update({k: v for k, v in engine(None, last, wall).items()})
  if len(steps) > 1:
    span = last["elapsed_s"] - steps[0]["elapsed_s"]
    rec.update({"steady_" + k: v for k, v in engine(steps[0], last, span).items()})
    s_tokens_per_s = common.median(tok_s[1:])
  else:
    rec.update({"steady_" + k: v for k, v in engine(None, last, wall).items()})
    s_tokens_per_s = common.median(tok_s)
  rec.update(steady_traj_per_s=batch * len(steady) / (s_wait + s_train),
             steady_trainer_idle=s_wait / (s_wait + s_train),
             steady_tokens_per_s_median=s_tokens_per_s,
             step_train_s_median=common.median([s["train_s"] for s in steady]),
             step_wait_s_median=common.median([s["wait_s"] for s in steady]))
  rec.update(mode=mode, steps=len(steps), rl_wall_s=wall, wait_s=wait, train_s=train,
             traj_per_s=n_traj / wall, tokens_per_s_median=common.median(tok_s),
             trainer_idle=wait / wall,
             tool_use=common.median([s.get("tool_use", 0.0) for s in steps]),
             response_tokens=common.median([s.get("response_tokens_mean", 0.0) for s in steps]),
             queue_mean=common.median([s.get("queue_size", 0) for s in steps]),
             staleness_mean=sum(s.get("staleness_mean", 0.0) for s in steps) / len(steps),
             first_step_overhead_s=steps[0]["train_s"] - rest[len(rest) // 2])
  return rec


COLUMNS = ("mode", "steps", "rl_wall_s", "traj_per_s", "steady_traj_per_s", "tokens_per_s_median",
           "steady_tokens_per_s_median", "trainer_idle", "steady_trainer_idle", "engine_idle",
           "steady_engine_idle", "steady_engine_idle_barrier", "steady_engine_idle_tools",
           "steady_engine_idle_queue_full", "steady_engine_busy", "steady_slot_occupancy",
           "steady_engine_traj_per_s",
           "step_train_s_median", "step_wait_s_median", "staleness_mean", "tool_use",
           "response_tokens",
           "queue_mean", "first_step_overhead_s")


def main():
  ap = common.parser(__doc__)
  ap.add_argument("--steps", type=int, default=12)
  ap.add_argument("--config", default="arith_tool", help="configs/<name>.py (its :smoke variant)")
  ap.add_argument("--modes", default="sao,grpo_sync")
  ap.add_argument("--tool_latency", default="",
                  help="long-tailed task: lognormal:MEDIAN_S:SIGMA per tool call ('' = off)")
  ap.add_argument("--backend", default="thread", choices=("thread", "ray"))
  ap.add_argument("--num_workers", type=int, default=2, help="rollout actors (--backend ray)")
  ap.set_defaults(repeats=2)
  args = ap.parse_args()
  median_s, sigma = parse_tool_latency(args.tool_latency)
  steps = 1 if args.quick else args.steps
  repeats = 1 if args.quick else args.repeats
  overrides = {"config": args.config, "train.num_steps": steps, "train.batch_size": 16,
               "train.group_size": 8, "rollout.slots": 16, "sft.steps": 20, "eval.every_steps": 0,
               "checkpoint.every_steps": 0, "task.n_eval": 16, "log.tensorboard": False,
               "log.progress": "off", "rollout.max_new_tokens": 24,
               "task.tool_latency_median_s": median_s, "task.tool_latency_sigma": sigma,
               "rollout.backend": args.backend,
               "train.critic_warmup_steps": 0}  # the pipeline from the first policy step on
  if args.backend == "ray":
    overrides.update({"rollout.num_workers": args.num_workers,
                      "rollout.ray_num_cpus": 2.0 / args.num_workers})
  latency = (f"lognormal per tool call: median {median_s} s, sigma {sigma} (mean "
             f"{median_s * math.exp(sigma ** 2 / 2):.3g} s, p99 "
             f"{median_s * math.exp(2.326 * sigma):.3g} s); env.step on rollout.slots threads"
             if median_s > 0 else "none (the ordinary task)")
  print(f"tool latency: {latency}", flush=True)
  rows = []
  with tempfile.TemporaryDirectory() as d:
    for r in range(repeats):
      for mode in args.modes.split(","):
        rec = run_mode(mode, overrides, os.path.join(d, f"{mode}_{r}"))
        rows.append({k: rec[k] for k in COLUMNS}
                    | {"peak_rss_MB": rec["peak_rss"] / 2**20,
                       "jit caches p/c/adv": f"{rec['cache_policy']}/{rec['cache_critic']}/"
                                             f"{rec['cache_adv']}"})
  steady = {m: common.median([r["steady_traj_per_s"] for r in rows if r["mode"] == m])
            for m in args.modes.split(",")}
  by = {m: common.median([r["traj_per_s"] for r in rows if r["mode"] == m])
        for m in args.modes.split(",")}
  ratio = by["sao"] / by["grpo_sync"] if len(by) == 2 else None
  common.report("pipeline", rows, args,
                {"overrides": overrides, "tool_latency": latency, "median_traj_per_s": by,
                 "sao_over_sync": ratio, "steady_traj_per_s": steady,
                 "steady_sao_over_sync": (steady["sao"] / steady["grpo_sync"]
                                          if len(steady) == 2 else None)})


if __name__ == "__main__":
  main()
