"""Peak memory and time of one SAO policy step (targets, K critic updates, policy update) at the
shapes of ``configs/smollm2_arith.py``: SmolLM2-135M (49,152-token vocabulary, 30 layers),
16 trajectories of 96 tokens.

    python benchmarks/smollm2_step_memory.py [--tokens_per_device N] [--repeats 3] [--repo DIR]

Random weights of the SmolLM2-135M shape (the step's memory and time do not depend on the
values). The step runs in a fresh subprocess per setting (``--repo`` chooses the checkout whose
``sao_jax`` it imports, so one script measures two commits); each subprocess reports the peak
resident set growth over the steps (``VmHWM`` after - ``VmRSS`` before the first step, from
/proc/self/status, so compilation counts too), the peak growth within the steps after the
first (the high-water mark reset through /proc/self/clear_refs: a step's own transient), the
resident growth after each step (a leak would climb), the XLA temp bytes of the compiled policy and
critic programs (``memory_analysis()``), and the median wall time of ``--repeats`` steps after
one warm-up step. ``--tokens_per_device 0`` is one pass over the whole batch (no
micro-batching); the config's 384 gives micro-batches of 4 rows.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r"""
import json, os, statistics, sys, time
sys.path.insert(0, sys.argv[1])
tokens_per_device, repeats = int(sys.argv[2]), int(sys.argv[3])

def status(key):
  for line in open("/proc/self/status"):
    if line.startswith(key):
      return int(line.split()[1]) * 1024

import jax, numpy as np
from flax import nnx
from sao_jax import configs
from sao_jax.models.presets import get_preset
from sao_jax.models.transformer import Transformer
from sao_jax.rollout.trajectory import Trajectory

config = configs.load("smollm2_arith")
config.mesh.tokens_per_device = tokens_per_device
try:  # commits before the composition root built the learner in train/setup.py from the config
  from sao_jax.train import setup as build
except ImportError:
  from sao_jax import build, roles
  config = roles.from_config(config)
mcfg = get_preset("smollm2-135m", max_seq_len=config.model.max_seq_len)
graphdef, params = nnx.split(Transformer(mcfg, rngs=nnx.Rngs(0)))
policy = build.Policy(mcfg, graphdef, nnx.to_pure_dict(params), "random")
learner = build.make_learner(config, policy, pad_id=0)
rng = np.random.default_rng(0)
B, T, P = config.train.batch_size, config.model.max_seq_len, 59
trajs = []
for i in range(B):
  n = int(rng.integers(8, T - P))
  tokens = rng.integers(1, mcfg.vocab_size, P + n).tolist()
  mask = [0] * P + [1] * n
  trajs.append(Trajectory(
      problem_id=str(i), tokens=np.asarray(tokens, np.int32),
      action_mask=np.asarray(mask, np.float32),
      logprobs=np.asarray([0.0] * P + (-rng.random(n) - 1).tolist(), np.float32),
      policy_version=np.asarray([-1] * P + [0] * n, np.int32), reward=float(i % 2)))
rss0 = status("VmRSS")
times, rss_steps = [], []
for i in range(repeats + 1):
  if i == 1:  # after the warm-up step (which compiles): reset the high-water mark
    peak = status("VmHWM") - rss0
    rss1 = status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
      f.write("5")
  t0 = time.perf_counter()
  out = learner.train_step(trajs, policy_version=1)
  jax.block_until_ready(learner.policy.params)
  times.append(time.perf_counter() - t0)
  rss_steps.append(round((status("VmRSS") - rss0) / 2**30, 3))
peak = max(peak, status("VmHWM") - rss0)
steady = status("VmHWM") - rss1
batch, micro = learner.batch(trajs)
fns = learner.jitted_steps(micro)
temps = {}
try:
  targets = fns[0](learner.critic.params, batch)
  critic = fns[1].lower(learner.critic, batch, targets).compile()
  temps["critic_temp_bytes"] = critic.memory_analysis().temp_size_in_bytes
  policy = fns[2].lower(learner.policy, batch, targets["advantages"], None).compile()
  temps["policy_temp_bytes"] = policy.memory_analysis().temp_size_in_bytes
except Exception as e:  # a different step signature on another commit
  temps["temp_bytes_error"] = repr(e)[:200]
print(json.dumps({"tokens_per_device": tokens_per_device, "microbatches": micro,
                  "peak_rss_growth_gb": peak / 2**30, "steady_peak_rss_growth_gb": steady / 2**30,
                  "rss_growth_after_each_step_gb": rss_steps,
                  "step_s": statistics.median(times[1:]),
                  "first_step_s": times[0], "policy_loss": out.get("policy_loss"),
                  **{k: (v / 2**30 if isinstance(v, int) else v) for k, v in temps.items()}}))
"""


def main():
  ap = argparse.ArgumentParser(description=__doc__)
  ap.add_argument("--tokens_per_device", default="0,384",
                  help="comma-separated mesh.tokens_per_device values, one subprocess each")
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--repo", default=ROOT, help="checkout whose sao_jax is measured")
  args = ap.parse_args()
  for tpd in args.tokens_per_device.split(","):
    out = subprocess.run([sys.executable, "-c", CHILD, os.path.abspath(args.repo), tpd,
                          str(args.repeats)], capture_output=True, text=True, check=False)
    lines = [l for l in out.stdout.splitlines() if l.startswith("{")]
    if out.returncode or not lines:
      print(f"tokens_per_device={tpd}: failed (rc {out.returncode})\n{out.stderr[-2000:]}")
      continue
    print(lines[-1], flush=True)


if __name__ == "__main__":
  main()
