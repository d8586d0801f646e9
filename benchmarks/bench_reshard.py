"""The in-process weight publish: a float32 master sharded over the learner's devices, cast to
the serving dtype and laid out on the rollout engine's devices (``placement.reshard``, what
``Learner.policy_params`` runs), against ``jax.device_put`` to the same shardings, in one run,
interleaved.

    python benchmarks/bench_reshard.py [--model qwen3-0.6b] [--repeats 3] [--json out.json]
                                       [--layouts 'tensor=4;data=2,tensor=2;data=4']
    python benchmarks/bench_reshard.py --model tiny-qwen3-moe --repeats 1 \
                                       --layouts 'tensor=2,expert=2;data=2,expert=2'
                                       # a check in seconds, expert layouts on an MoE

``--layouts``: ``rollout.mesh`` values over the 4 rollout devices, ';'-separated (quote them).

Runs on 8 devices (on CPU it forces 8 host devices): the learner's ``fsdp=4`` mesh on the first 4
(``sharding.LOGICAL_RULES``), the engine's mesh on the other 4 (``placement.rollout_mesh``,
``sharding.ROLLOUT_RULES``). Per layout and round: ``cast`` (the float32 master to bfloat16, on the
learner's mesh), ``reshard`` (``placement.reshard`` of the cast tree: device to device, piece by
piece) and ``device_put`` (``jax.device_put(cast, target)``: JAX's own move between the two device
sets, which goes through the host for a change of layout). GB/s = bytes the rollout devices
receive (the sum of the target shards: a replicated layout receives one copy per device) /
seconds: a replicated layout counts every copy it receives (``data=4`` receives the tree 4
times), where ``bench_weight_sync.py`` counts 2 x the tree for its 2 actors. Every result is
checked equal to the cast tree. On CPU "device to device" is a host
memcpy between buffers, so these are memory-bandwidth figures for this machine, not ICI numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

if "jax" not in sys.modules and "xla_force_host_platform_device_count" not in os.environ.get(
    "XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8").strip()

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

import jax  # noqa: E402  pylint: disable=wrong-import-position
import jax.numpy as jnp  # noqa: E402  pylint: disable=wrong-import-position
import numpy as np  # noqa: E402  pylint: disable=wrong-import-position

from sao_jax import plan  # noqa: E402  pylint: disable=wrong-import-position
from sao_jax.models import presets  # noqa: E402  pylint: disable=wrong-import-position
from sao_jax.models.transformer import Transformer  # noqa: E402  pylint: disable=wrong-import-position
from sao_jax.rollout import placement  # noqa: E402  pylint: disable=wrong-import-position
from sao_jax.train import sharding  # noqa: E402  pylint: disable=wrong-import-position


def master(model: str, mesh):
  """Random float32 params of preset ``model`` laid out by ``sharding.LOGICAL_RULES`` on
  ``mesh``, made on the devices (a jitted init per leaf with its output sharding)."""
  mcfg = presets.get_preset(model, param_dtype="float32", dtype="float32")
  _, abstract = plan.abstract_params(Transformer, mcfg)
  shardings = sharding.param_shardings(abstract, mesh)
  leaves, treedef = jax.tree.flatten(abstract)
  made = []
  for i, (x, s) in enumerate(zip(leaves, jax.tree.leaves(shardings))):
    fn = jax.jit(lambda k, shape=x.shape: jax.random.normal(k, shape, jnp.float32) * 0.02,
                 out_shardings=s)
    made.append(fn(jax.random.key(i)))
  return jax.tree.unflatten(treedef, made)


def received_bytes(tree) -> int:
  """Bytes held over all devices (each shard of a replicated array counted)."""
  return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards)


def check(out, ref) -> bool:
  """Every leaf of ``out`` equals ``ref`` (compared on one shard per distinct block)."""
  for x, r in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
    r = np.asarray(r)
    for s in x.addressable_shards:
      if not np.array_equal(np.asarray(s.data), r[s.index]):
        return False
  return True


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--model", default="qwen3-0.6b", help="a preset of sao_jax/models/presets.py")
  ap.add_argument("--layouts", default="tensor=4;data=2,tensor=2;data=4",
                  help="rollout.mesh values over the 4 rollout devices, ';'-separated")
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--json", default="")
  args = ap.parse_args()
  devices = jax.devices()
  if len(devices) != 8:
    raise SystemExit(f"needs 8 devices, found {len(devices)} (on CPU run it in a fresh process: "
                     "it forces 8 host devices)")
  train = sharding.make_mesh({"fsdp": 4}, devices[4:])
  params = master(args.model, train)
  cast_fn = jax.jit(lambda t: jax.tree.map(lambda x: x.astype(jnp.bfloat16), t))
  tree_gb = sum(x.nbytes for x in jax.tree.leaves(params)) / 2 / 1e9
  load = os.getloadavg()[0]
  print(f"{args.model}: {len(jax.tree.leaves(params))} leaves, {1e3 * tree_gb:.1f} MB in bfloat16; "
        f"learner fsdp=4 on devices {[d.id for d in devices[4:]]}, rollout on "
        f"{[d.id for d in devices[:4]]}; load avg {load:.1f}", flush=True)
  rows = []
  for text in args.layouts.split(";"):
    target = placement.serving_shardings(params, placement.rollout_mesh(text, devices[:4]))
    ref = None
    for rnd in range(args.repeats + 1):  # round 0 compiles the slices and casts: not reported
      t0 = time.perf_counter()
      cast = jax.block_until_ready(cast_fn(params))
      t_cast = time.perf_counter() - t0
      if ref is None:
        ref = jax.device_get(cast)
      for how in ("reshard", "device_put"):
        t0 = time.perf_counter()
        out = (placement.reshard(cast, target) if how == "reshard"
               else jax.device_put(cast, target, may_alias=False))
        jax.block_until_ready(out)
        dt = time.perf_counter() - t0
        nbytes = received_bytes(out)
        ok = check(out, ref) if rnd in (0, args.repeats) else None
        del out
        if rnd:
          rows.append({"layout": text, "how": how, "round": rnd, "cast_s": t_cast, "s": dt,
                       "received_gb": nbytes / 1e9, "gbps": nbytes / 1e9 / dt, "equal": ok})
          print(f"{text:18s} {how:10s} round {rnd}: cast {t_cast:.3f} s, move {dt:.3f} s, "
                f"{nbytes / 1e6:.1f} MB received, {nbytes / 1e9 / dt:.3f} GB/s"
                + ("" if ok is None else f", equal={ok}"), flush=True)
        elif not ok:
          raise SystemExit(f"{how} to {text}: result differs from the cast tree")
      del cast
  print("\nlayout | how | median move s | MB received | median GB/s | cast s (median)")
  for text in args.layouts.split(";"):
    for how in ("reshard", "device_put"):
      r = [x for x in rows if x["layout"] == text and x["how"] == how]
      print(f"{text} | {how} | {statistics.median(x['s'] for x in r):.3f} | "
            f"{1e3 * r[0]['received_gb']:.1f} | {statistics.median(x['gbps'] for x in r):.3f} | "
            f"{statistics.median(x['cast_s'] for x in r):.3f}")
  print(f"load avg at the end {os.getloadavg()[0]:.1f}")
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump({"model": args.model, "tree_gb": tree_gb, "rows": rows,
                 "load": [load, os.getloadavg()[0]]}, f, indent=1)


if __name__ == "__main__":
  main()
