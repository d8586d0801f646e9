"""Peak host memory of loading a sharded Hugging Face checkpoint with sao_jax.models.hf.

    python benchmarks/load_memory.py [--layers 8] [--shard_mb 16]

Writes a synthetic Qwen3-MoE checkpoint (random float32 weights, N shards + index) with
``save_hf_checkpoint``, then loads it in a fresh subprocess and reports the peak resident set
growth during the load (``VmHWM`` after - ``VmRSS`` before, from /proc/self/status) against the
bound ``1.5 x largest shard + model bytes``. Prints one JSON line.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

CHILD = r"""
import json, os, sys
sys.path.insert(0, sys.argv[2])
import jax, numpy as np
from sao_jax.models import hf

def status(key):
  for line in open("/proc/self/status"):
    if line.startswith(key):
      return int(line.split()[1]) * 1024
# warm-up on a tiny checkpoint: imports, tracing, allocator pools
hf.load_hf_checkpoint(sys.argv[3])
before = status("VmRSS")
# reset the high-water mark so VmHWM is the peak during the load below
open("/proc/self/clear_refs", "w").write("5")
cfg, params = hf.load_hf_checkpoint(sys.argv[1])
jax.block_until_ready(params)
peak = status("VmHWM")
model = sum(x.nbytes for x in jax.tree.leaves(params))
print(json.dumps({"before": before, "peak": peak, "model_bytes": model}))
"""


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--layers", type=int, default=8)
  ap.add_argument("--d_model", type=int, default=512)
  ap.add_argument("--shard_mb", type=float, default=16)
  args = ap.parse_args()
  import jax
  import numpy as np
  from sao_jax.models import hf, presets
  cfg = presets.get_preset("tiny-qwen3-moe", d_model=args.d_model, n_layers=args.layers,
                           head_dim=64, n_heads=8, n_kv_heads=4, d_ff=1024, moe_d_ff=512,
                           n_experts=8, moe_layers=tuple(range(args.layers)), vocab_size=8192)
  shapes = hf.param_shapes(cfg)
  rng = np.random.default_rng(0)
  params = jax.tree.map(lambda s: rng.standard_normal(s.shape, dtype=np.float32), shapes)
  tiny = presets.get_preset("tiny-qwen3-moe")
  with tempfile.TemporaryDirectory() as d:
    big, small = os.path.join(d, "big"), os.path.join(d, "small")
    files = hf.save_hf_checkpoint(big, cfg, params, max_shard_bytes=int(args.shard_mb * 2**20))
    hf.save_hf_checkpoint(small, tiny, jax.tree.map(
        lambda s: np.zeros(s.shape, np.float32), hf.param_shapes(tiny)))
    del params
    largest = max(os.path.getsize(f) for f in files)
    out = subprocess.run([sys.executable, "-c", CHILD, big, ROOT, small], capture_output=True,
                         text=True, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
  growth = r["peak"] - r["before"]
  bound = 1.5 * largest + r["model_bytes"]
  print(json.dumps({"shards": len(files), "largest_shard_mb": largest / 2**20,
                    "model_mb": r["model_bytes"] / 2**20, "peak_growth_mb": growth / 2**20,
                    "bound_mb": bound / 2**20, "within_bound": growth < bound,
                    "growth_over_model_mb": (growth - r["model_bytes"]) / 2**20}))


if __name__ == "__main__":
  main()
