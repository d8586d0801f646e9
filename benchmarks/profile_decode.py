"""Where a decode step's time goes: one token per slot through the model with its KV cache (what
the JetStream engine's ``generate`` runs per step), traced with ``jax.profiler`` on XLA:CPU and
summed per source function / op kind (the parsing of ``profile_ops.py``).

    python benchmarks/profile_decode.py [--batch 32] [--cache_len 81] [--pos 40] [--kv_len -1]
        [--repeats 50]

Model: the sampler benchmark's small config (``bench_sampler.config``). ``--cache_len`` defaults
to the engine's ``max_seq_len + 1`` for that benchmark (81). Every row decodes at ``--pos``
(default ``cache_len // 2``); ``--kv_len`` is the number of cache positions attended over (0 = the
whole cache; -1 = the engine's live-length bucket for that position, ``engine.live_kv_len``).
"""

from __future__ import annotations

import collections
import functools

import common  # pylint: disable=import-error
import jax
import jax.numpy as jnp
from flax import nnx

import bench_sampler  # pylint: disable=import-error
import profile_ops  # pylint: disable=import-error
from sao_jax.models.transformer import Transformer, init_cache
from sao_jax.rollout.engine import live_kv_len


def main():
  ap = common.parser(__doc__, malloc_flag=True)
  ap.add_argument("--batch", type=int, default=32)
  ap.add_argument("--cache_len", type=int, default=81)
  ap.add_argument("--pos", type=int, default=-1)
  ap.add_argument("--kv_len", type=int, default=-1)
  ap.add_argument("--top", type=int, default=12)
  args = ap.parse_args()
  common.apply_malloc(args)
  cfg = bench_sampler.config(args.quick, 64)
  b, n = (2, 2) if args.quick else (args.batch, args.repeats)
  graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))

  pos = args.pos if args.pos >= 0 else args.cache_len // 2
  kv_len = (args.kv_len if args.kv_len >= 0 else live_kv_len(pos + 1, args.cache_len)) or None

  @functools.partial(jax.jit, donate_argnums=(1,))  # the engine donates its decode state too
  def decode(params, cache, tokens, positions):
    logits, cache = nnx.merge(graphdef, params)(tokens, positions, cache, kv_len=kv_len)
    return jnp.argmax(logits[:, -1], -1), cache

  cache = init_cache(cfg, b, args.cache_len)
  tokens = jnp.ones((b, 1), jnp.int32)
  positions = jnp.full((b, 1), pos, jnp.int32)
  text = decode.lower(params, cache, tokens, positions).compile().as_text()
  for _ in range(3):
    _, cache = jax.block_until_ready(decode(params, cache, tokens, positions))
  state = {"cache": cache}

  def run():
    _, state["cache"] = jax.block_until_ready(decode(params, state["cache"], tokens, positions))

  per_op = profile_ops.trace_ops(run, n)
  idx = profile_ops._op_index(text, profile_ops._stack_frames(text))  # pylint: disable=protected-access
  total = sum(per_op.values())
  by_src, by_kind = collections.defaultdict(float), collections.defaultdict(float)
  for op, ms in per_op.items():
    _, _, src = idx.get(op, ("", "-", "runtime"))
    by_src[src] += ms
    by_kind[profile_ops._kind(op)] += ms  # pylint: disable=protected-access
  rows = lambda tab: [{"part": k, "traced ms/step": v, "share": v / total}
                      for k, v in sorted(tab.items(), key=lambda kv: -kv[1])]
  name = f"profile_decode (batch {b}, cache_len {args.cache_len}, kv_len {kv_len})"
  common.report(f"{name}: by source function", rows(by_src)[:args.top], args,
                {"traced ms/step": total})
  common.report(f"{name}: by op kind", rows(by_kind)[:8], profile_ops.argparse_no_json(args))


if __name__ == "__main__":
  main()
