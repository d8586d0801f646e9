"""FLOPs and memory of one Qwen3-30B-A3B-shaped MoE layer, routed vs dense, from the compiler.

``python benchmarks/moe_flops.py [--tokens 512] [--tpu v5e:2x2]``

One MoE layer (E=128 experts, top-8, d_model 2048, expert width 768, bfloat16) on N tokens:
``transformer.moe_routed`` (sort-based dispatch + ``jax.lax.ragged_dot``) and
``transformer.moe_dense`` (every expert for every token), compiled ahead of time (abstract
arguments, nothing runs) for this host's CPU and, when ``libtpu`` is installed, for one chip of a
TPU topology and for the same topology with the experts sharded over every chip (``expert``
axis). Printed per program: ``cost_analysis()`` FLOPs of the forward and of forward + backward
(gradients of every input), their ratio to the ideal routed count ``3 * 2 * N * k * D * F``
(forward), the forward's temporary bytes, and for the sharded compile the collectives XLA
inserted. Nothing is timed.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
for key, value in (("TPU_SKIP_MDS_QUERY", "1"), ("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")):
  os.environ.setdefault(key, value)  # AOT only: no TPU metadata server, no exclusive lock

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from sao_jax.models.transformer import moe_dense, moe_routed  # noqa: E402

E, K, D, F = 128, 8, 2048, 768
COLLECTIVES = r"(all-gather|all-reduce|all-to-all|reduce-scatter|collective-permute)"


def measure(n: int, sharding_of) -> list[dict]:
  """sharding_of(logical) -> a Sharding for 'x' (tokens), 'w' (expert weights)."""
  s = lambda shape, dtype, kind: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding_of(kind))
  args = (s((n, D), jnp.bfloat16, "x"), s((n, E), jnp.float32, "x"),
          s((E, D, F), jnp.bfloat16, "w"), s((E, D, F), jnp.bfloat16, "w"),
          s((E, F, D), jnp.bfloat16, "w"))
  ideal = 3 * 2 * n * K * D * F
  rows = []
  for name, fn in (("dense", moe_dense), ("routed", moe_routed)):
    f = lambda x, r, g, u, d, fn=fn: fn(x, r, g, u, d, K, True)
    fwd = jax.jit(f).lower(*args).compile()
    grad = jax.jit(jax.grad(lambda *a, f=f: f(*a).astype(jnp.float32).sum(),
                            argnums=range(5))).lower(*args).compile()
    colls = sorted(set(re.findall(rf"{COLLECTIVES}(?:-start)?\(", fwd.as_text())))
    rows.append(dict(impl=name, fwd=fwd.cost_analysis()["flops"],
                     fwd_bwd=grad.cost_analysis()["flops"], ideal=ideal,
                     temp=fwd.memory_analysis().temp_size_in_bytes, collectives=colls))
  return rows


def show(title: str, rows: list[dict]) -> None:
  print(f"\n{title}")
  print("| impl | fwd GFLOP | x ideal routed | fwd+bwd GFLOP | fwd temp MiB | collectives (fwd) |")
  print("|---|---|---|---|---|---|")
  for r in rows:
    print(f"| {r['impl']} | {r['fwd'] / 1e9:.1f} | {r['fwd'] / r['ideal']:.2f} | "
          f"{r['fwd_bwd'] / 1e9:.1f} | {r['temp'] / 2**20:.0f} | "
          f"{', '.join(r['collectives']) or '-'} |")


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--tokens", type=int, default=512)
  ap.add_argument("--tpu", default="v5e:2x2", help="topology for the TPU compiles ('' = none)")
  a = ap.parse_args()
  print(f"one MoE layer: E={E}, k={K}, D={D}, F={F}, bfloat16, N={a.tokens} tokens; jax "
        f"{jax.__version__}")
  cpu = jax.devices("cpu")[0]
  show(f"CPU ({cpu.device_kind})",
       measure(a.tokens, lambda kind: jax.sharding.SingleDeviceSharding(cpu)))
  if not a.tpu:
    return
  try:
    from jax.experimental import topologies
    devices = topologies.get_topology_desc(topology_name=a.tpu, platform="tpu").devices
  except Exception as e:  # noqa: BLE001 -- libtpu missing or refusing: say so, keep the CPU table
    print(f"\nTPU compile skipped ({type(e).__name__}: {str(e)[:200]}); needs libtpu "
          "(jax 0.10.2: libtpu==0.0.42.*).")
    return
  show(f"TPU {a.tpu}, one chip ({devices[0].device_kind})",
       measure(a.tokens, lambda kind: jax.sharding.SingleDeviceSharding(devices[0])))
  mesh = Mesh(np.array(devices), ("expert",))
  show(f"TPU {a.tpu}, experts sharded over {len(devices)} chips (per-chip FLOPs; tokens "
       "replicated)",
       measure(a.tokens, lambda kind: NamedSharding(mesh, P("expert") if kind == "w" else P())))


if __name__ == "__main__":
  main()
