"""Memory and compile cost of ``model.remat`` / ``model.scan_layers`` (XLA:CPU, compile only).

``python benchmarks/remat_memory.py [--seq 512] [--layers 1,8,28]`` prints three markdown tables:

1. temp bytes (``compiled.memory_analysis()``) of a value_and_grad of a token log-likelihood,
   4 layers, batch 2 x ``--seq`` tokens, float32, for every remat x scan setting;
2. the stacked-weights cost of a scan: temp bytes at 1 x 8 tokens (activations negligible), for
   float32 / float32-master-with-bfloat16-compute / bfloat16 parameters, forward and backward;
3. lowering and compile time (process CPU seconds, robust to a loaded host; wall seconds
   beside) of the same backward, remat "block", at each ``--layers`` depth, scan off / on.

The model: the ``tiny-qwen3`` preset widened to d_model 256, d_ff 768, 8 heads (4 KV) of 32,
vocab 512. No weights are built (``nnx.eval_shape``). Results: ``benchmarks/RESULTS.md``
section 5.

``--tpu v5e:2x2`` instead compiles ahead of time for one chip of that TPU topology (needs
``libtpu``; ``ALLOW_MULTIPLE_LIBTPU_LOAD=1`` if another process holds it): the ``qwen3-0.6b``
preset cut to 4 layers, float32 parameters, bfloat16 compute, 2 x 2048 tokens, every remat x
scan setting: temp / argument GiB and compile CPU seconds (minutes each on a loaded 2-core host).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from sao_jax.models.presets import get_preset  # noqa: E402
from sao_jax.models.transformer import Transformer, default_positions  # noqa: E402

MIB = 2 ** 20


def model(**kw):
  return get_preset("tiny-qwen3", d_model=256, d_ff=768, n_heads=8, n_kv_heads=4, head_dim=32,
                    vocab_size=512, **kw)


def lower(cfg, batch: int, seq: int, grad: bool = True):
  graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
  tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)

  def loss(state, tokens):
    logits, _ = nnx.merge(graphdef, state)(tokens, default_positions(tokens))
    logp = jax.nn.log_softmax(logits[:, :-1])
    return jnp.sum(jnp.take_along_axis(logp, tokens[:, 1:, None], -1))

  return jax.jit(jax.value_and_grad(loss) if grad else loss).lower(state, tokens)


def temp_mib(cfg, batch, seq, grad=True) -> float:
  return lower(cfg, batch, seq, grad).compile().memory_analysis().temp_size_in_bytes / MIB


def tpu_table(topology: str):
  import numpy as np
  from jax.experimental import topologies
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  topo = topologies.get_topology_desc(topology_name=topology, platform="tpu")
  rep = NamedSharding(Mesh(np.array(topo.devices[:1]), ("x",)), P())
  tokens = jax.ShapeDtypeStruct((2, 2048), jnp.int32, sharding=rep)
  print(f"\n### TPU ({topology}, one chip) backward, qwen3-0.6b x 4 layers, 2 x 2048 tokens, "
        "float32 params, bfloat16 compute\n")
  print("| remat | scan | temp | arguments | compile CPU s |\n|---|---|---|---|---|")
  for remat in ("none", "block", "dots_saveable"):
    for scan in (False, True):
      cfg = get_preset("qwen3-0.6b", n_layers=4, max_seq_len=2048, param_dtype="float32",
                       dtype="bfloat16", remat=remat, scan_layers=scan)
      graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
      state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep), state)

      def loss(state, tokens, graphdef=graphdef):
        logits, _ = nnx.merge(graphdef, state)(tokens, default_positions(tokens))
        logp = jax.nn.log_softmax(logits[:, :-1])
        return jnp.sum(jnp.take_along_axis(logp, tokens[:, 1:, None], -1))

      c0 = time.process_time()
      m = jax.jit(jax.value_and_grad(loss)).lower(state, tokens).compile().memory_analysis()
      print(f"| {remat} | {scan} | {m.temp_size_in_bytes / 2**30:.2f} GiB | "
            f"{m.argument_size_in_bytes / 2**30:.2f} GiB | {time.process_time() - c0:.0f} |",
            flush=True)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--seq", type=int, default=512)
  ap.add_argument("--layers", default="1,8,28")
  ap.add_argument("--tpu", default="", help="TPU topology, e.g. v5e:2x2 (AOT, needs libtpu)")
  args = ap.parse_args()
  if args.tpu:
    return tpu_table(args.tpu)
  print(f"load average {os.getloadavg()[0]:.1f}; XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")

  print(f"\n### Backward temp bytes, 4 layers, 2 x {args.seq} tokens, float32\n")
  print("| remat | scan_layers=False | scan_layers=True |\n|---|---|---|")
  for remat in ("none", "block", "dots_saveable"):
    row = [temp_mib(model(n_layers=4, max_seq_len=args.seq, remat=remat, scan_layers=s), 2,
                    args.seq) for s in (False, True)]
    print(f"| {remat} | {row[0]:.1f} MiB | {row[1]:.1f} MiB |", flush=True)

  print("\n### Stacked weights: temp bytes at 1 x 8 tokens, 4 layers\n")
  print("| params / compute | layer weights | program | unrolled | scan | scan + block |")
  print("|---|---|---|---|---|---|")
  for pdt, dt in (("float32", "float32"), ("float32", "bfloat16"), ("bfloat16", "bfloat16")):
    base = model(n_layers=4, param_dtype=pdt, dtype=dt)
    state = nnx.split(nnx.eval_shape(lambda: Transformer(base, rngs=nnx.Rngs(0))))[1]
    weights = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(state["layers"])) / MIB
    for grad in (False, True):
      row = [temp_mib(dataclasses.replace(base, remat=r, scan_layers=s), 1, 8, grad)
             for r, s in (("none", False), ("none", True), ("block", True))]
      print(f"| {pdt} / {dt} | {weights:.2f} MiB | {'backward' if grad else 'forward'} | "
            + " | ".join(f"{t:.2f} MiB" for t in row) + " |", flush=True)

  print("\n### Lowering and compile time of the backward (remat block, 2 x 256 tokens)\n")
  print("| layers | scan | lower (CPU s / wall s) | compile (CPU s / wall s) | temp |")
  print("|---|---|---|---|---|")
  for n in (int(x) for x in args.layers.split(",")):
    for scan in (False, True):
      cfg = model(n_layers=n, max_seq_len=256, remat="block", scan_layers=scan)
      c0, w0 = time.process_time(), time.perf_counter()
      lowered = lower(cfg, 2, 256)
      c1, w1 = time.process_time(), time.perf_counter()
      compiled = lowered.compile()
      c2, w2 = time.process_time(), time.perf_counter()
      temp = compiled.memory_analysis().temp_size_in_bytes / MIB
      print(f"| {n} | {scan} | {c1 - c0:.2f} / {w1 - w0:.2f} | {c2 - c1:.2f} / {w2 - w1:.2f} | "
            f"{temp:.1f} MiB |", flush=True)
  print(f"\nload average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
  main()
