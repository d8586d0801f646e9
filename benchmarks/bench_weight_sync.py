"""Weight sync of a >= 1.5 GB parameter tree to 2 Ray actors: ``jax.experimental.transfer`` vs
the Ray object store (``sao_jax/rollout/weight_sync.py``), whole tree in one bucket vs in
buckets, in one run, interleaved.

    python benchmarks/bench_weight_sync.py [--gb 1.6] [--repeats 2] [--bucket_mb 0,512]
                                           [--json out.json]

Per transport, bucket size (``rollout.weight_bucket_mb``; 0 = the whole tree in one transfer
pull / one Ray object, the layout before buckets) and round: the trainer publishes a new version
(``publish``: what the trainer's loop waits for; for the object store this includes
``ray.put`` of the host copy, one bucket at a time), the driver arms one ref per actor
(``ref_for``), then both actors pull it at the same time; the round's time is publish + arm +
the slower actor's pull, from the driver. GB/s = 2 x tree bytes /
round time (bytes delivered to the two actors per second). Every pull is checked (a checksum of
the first and last leaf against the trainer's). The first round of each transport also opens
its connections; both are reported. Memory: trainer tree + 2 pulled copies (+ one host copy and
one object-store copy for the object store) are alive at once: ~5 x the tree at the peak; every
copy is freed after its round. The object store is sized for 2.5 trees: a version still pinned
by an actor's arrays while the next is put would otherwise spill to disk (slow pulls).
Set ``--gb`` lower on a small machine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

import jax  # pylint: disable=wrong-import-position
import jax.numpy as jnp  # pylint: disable=wrong-import-position
import numpy as np  # pylint: disable=wrong-import-position

from sao_jax.rollout import ray_local, weight_sync  # pylint: disable=wrong-import-position

LEAF_MB = 64


class Receiver:
  """A rollout-actor stand-in: pulls a ``WeightRef`` and drops it (no model, no engine)."""

  def __init__(self):
    self.puller = weight_sync.WeightPuller()

  def pull(self, ref) -> tuple[float, float, float]:  # the actor's pull thread does the same
    """Returns (pull seconds, sum of the first leaf, sum of the last leaf)."""
    t0 = time.perf_counter()
    leaves = jax.block_until_ready(self.puller.pull_leaves(ref))
    dt = time.perf_counter() - t0
    out = (dt, float(jnp.sum(leaves[0][:1024])), float(jnp.sum(leaves[-1][-1024:])))
    del leaves
    return out


def make_tree(gb: float):
  """float32 leaves of LEAF_MB MiB each (and one bfloat16 leaf), >= ``gb`` GB in total."""
  n_per = LEAF_MB * 2 ** 20 // 4
  n_leaves = max(2, int(np.ceil(gb * 1e9 / (n_per * 4))))
  tree = {f"layer_{i:02d}": jnp.full((n_per,), float(i + 1), jnp.float32)
          for i in range(n_leaves - 1)}
  tree["embed_bf16"] = jnp.full((2 * n_per,), 0.5, jnp.bfloat16)  # same bytes as 2 f32 leaves
  return jax.block_until_ready(tree)


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--gb", type=float, default=1.6, help="parameter tree size, GB (1e9 bytes)")
  ap.add_argument("--repeats", type=int, default=2, help="rounds per transport")
  ap.add_argument("--bucket_mb", default="0,512",
                  help="bucket sizes to compare, MiB, comma-separated (0 = whole tree)")
  ap.add_argument("--json", default="", help="write the results here")
  args = ap.parse_args()
  import ray  # pylint: disable=import-outside-toplevel
  load0 = os.getloadavg()
  with open("/proc/meminfo", encoding="utf-8") as f:
    avail_gb = int([l for l in f if l.startswith("MemAvailable")][0].split()[1]) / 1e6
  tree = make_tree(args.gb)
  nbytes = sum(x.nbytes for x in jax.tree.leaves(tree))
  leaves = jax.tree.leaves(tree)
  want = (float(jnp.sum(leaves[0][:1024])), float(jnp.sum(leaves[-1][-1024:])))
  ray_local.init_ray(num_cpus=2, log_to_driver=False,  # listening on 127.0.0.1 only
                     object_store_memory=int(nbytes * 2.5),
                     runtime_env={"env_vars": {"PYTHONPATH": ROOT}})
  try:
    actors = [ray.remote(Receiver).options(num_cpus=0.5).remote() for _ in range(2)]
    ray.get([a.__ray_ready__.remote() for a in actors])
    buckets = [float(b) for b in args.bucket_mb.split(",")]
    pubs = {(name, mb): weight_sync.WeightPublisher(name, bucket_bytes=int(mb * 2 ** 20))
            for name in ("transfer", "object_store") for mb in buckets}
    rows, version = [], 0
    for rnd in range(args.repeats):
      for (name, mb), pub in pubs.items():  # interleaved: load from other jobs hits all alike
        version += 1
        t0 = time.perf_counter()
        pub.publish(tree, version)
        t_pub = time.perf_counter() - t0
        refs = [pub.ref_for() for _ in actors]
        t_arm = time.perf_counter() - t0 - t_pub
        got = ray.get([a.pull.remote(r) for a, r in zip(actors, refs)])
        total = time.perf_counter() - t0
        for _, s0, s1 in got:
          assert (s0, s1) == want, f"{name}: pulled {s0, s1}, trainer has {want}"
        rows.append({"transport": name, "bucket_mb": mb, "buckets": len(refs[0].buckets),
                     "round": rnd + 1, "publish_s": t_pub, "arm_s": t_arm,
                     "pull_s": [g[0] for g in got], "total_s": total,
                     "gb_per_s": 2 * nbytes / total / 1e9})
        pub.close()  # drop this version (frees the object-store copy)
        del refs, got
    load1 = os.getloadavg()
  finally:
    ray.shutdown()
  print(f"tree {nbytes / 1e9:.2f} GB ({len(leaves)} leaves) -> 2 actors; "
        f"load avg {load0[0]:.1f} -> {load1[0]:.1f} on {os.cpu_count()} cores; "
        f"{avail_gb:.1f} GB available at start")
  print("| transport | bucket MiB (buckets) | round | publish s | arm s | pull s (actor 0, 1) "
        "| total s | GB/s (2 x tree / total) |")
  print("|---|---|---|---|---|---|---|---|")
  for r in rows:
    print(f"| {r['transport']} | {r['bucket_mb']:g} ({r['buckets']}) | {r['round']} | "
          f"{r['publish_s']:.2f} | {r['arm_s']:.3f} | "
          f"{r['pull_s'][0]:.3f}, {r['pull_s'][1]:.3f} | {r['total_s']:.2f} | "
          f"{r['gb_per_s']:.2f} |")
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump({"nbytes": nbytes, "load": [load0, load1], "rows": rows}, f, indent=1)


if __name__ == "__main__":
  main()
