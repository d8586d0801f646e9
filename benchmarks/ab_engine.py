"""A/B in one process: decode-only tok/s of ``SAOEngine`` at an earlier commit vs the working
tree (and the working tree with the live-length bucket off), same params, the sampler
benchmark's small config and workload (``bench_sampler``: 16-token prompts, ``--new`` tokens).

    python benchmarks/ab_engine.py [--commit a136f52] [--batches 8,32,128] [--repeats 4]
        [--decode_steps 8] [--max_seq_len 512]

The old ``models/transformer.py`` and ``rollout/engine.py`` are read with ``git show`` into a
temporary folder and imported as separate modules. Decode-only medians skip the first timed
round; "total" includes the prefills. Engines with ``generate_steps`` (both sides from
``dc0ae7a`` on) run the batched path when ``--decode_steps`` > 1: one ``prefill_insert``, then
``new / decode_steps`` calls of ``generate_steps``.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import tempfile
import time

import common  # pylint: disable=import-error
import jax
import numpy as np
from flax import nnx

import bench_sampler  # pylint: disable=import-error
from sao_jax.models.transformer import Transformer
from sao_jax.rollout.engine import SAOEngine


def _old_modules(commit: str, folder: str):
  def show(path):
    return subprocess.run(["git", "show", f"{commit}:{path}"], check=True, capture_output=True,
                          text=True).stdout
  with open(os.path.join(folder, "old_transformer.py"), "w", encoding="utf-8") as f:
    f.write(show("sao_jax/models/transformer.py"))
  with open(os.path.join(folder, "old_engine.py"), "w", encoding="utf-8") as f:
    f.write(show("sao_jax/rollout/engine.py").replace("from sao_jax.models.transformer import",
                                                      "from old_transformer import"))
  sys.path.insert(0, folder)
  import old_engine  # pylint: disable=import-outside-toplevel,import-error
  import old_transformer  # pylint: disable=import-outside-toplevel,import-error
  return old_engine, old_transformer


def main():
  ap = common.parser(__doc__)
  ap.add_argument("--commit", default="a136f52")
  ap.add_argument("--batches", default="8,32,128")
  ap.add_argument("--new", type=int, default=64)
  ap.add_argument("--max_seq_len", type=int, default=0,
                  help="model max_seq_len (the cache holds max_seq_len + 1 positions); 0: prompt "
                       "+ new, the cache the workload fills")
  ap.add_argument("--decode_steps", type=int, default=8,
                  help="tokens per generate_steps call, for engines that have it (1: the "
                       "JetStream API, one prefill + insert per prompt and one generate per token)")
  args = ap.parse_args()
  new, prompt = (4, 16) if args.quick else (args.new, bench_sampler.PROMPT)
  args.decode_steps = max(1, min(args.decode_steps, new))  # --quick: 4 new tokens
  if new % args.decode_steps:
    raise ValueError(f"--new={new} must be a multiple of --decode_steps={args.decode_steps}")
  batches = [2] if args.quick else [int(x) for x in args.batches.split(",")]
  with tempfile.TemporaryDirectory() as d:
    old_engine, old_tf = _old_modules(args.commit, d)
    cfg = bench_sampler.config(args.quick, new)
    if args.max_seq_len:  # a longer cache than the workload fills: where the live length counts
      cfg = dataclasses.replace(cfg, max_seq_len=args.max_seq_len)
    ocfg = old_tf.ModelConfig(**{f: getattr(cfg, f) for f in cfg.__dataclass_fields__})
    graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
    params = nnx.to_pure_dict(params)
    old_graphdef, _ = nnx.split(old_tf.Transformer(ocfg, rngs=nnx.Rngs(0)))
    rows = []
    for b in batches:
      kw = dict(max_concurrent_decodes=b, max_prefill_length=prompt, temperature=1.0)
      engines = {"old": old_engine.SAOEngine(ocfg, old_graphdef, None, **kw),
                 "new": SAOEngine(cfg, graphdef, None, **kw),
                 "new, live length off": SAOEngine(cfg, graphdef, None, kv_bucket=1 << 20, **kw)}
      prompts = np.random.default_rng(b).integers(1, cfg.vocab_size, (b, prompt)).astype(np.int32)
      decode = {k: [] for k in engines}

      def rollout(name, engine):
        batched = args.decode_steps > 1 and hasattr(engine, "generate_steps")

        def run():
          state = engine.init_decode_state()
          if batched:
            state, _, _ = engine.prefill_insert(params, state, range(b), prompts)
          else:
            for i in range(b):
              pre = engine.prefill(params=params, padded_tokens=prompts[i], true_length=prompt)
              state = engine.insert(pre, state, i)
          jax.block_until_ready(state)
          t0, toks = time.perf_counter(), []
          if batched:
            for _ in range(new // args.decode_steps):
              state, tok, _ = engine.generate_steps(params, state, args.decode_steps)
              toks.append(tok)
          else:
            for _ in range(new):
              state, res = engine.generate(params, state)
              toks.append(res.data)
          jax.block_until_ready(toks)
          lengths = getattr(state, "host_lengths", None)  # older engines do not track them
          if lengths is not None and min(lengths) != min(prompt + new, cfg.max_seq_len):
            raise RuntimeError(f"{name}: the timed block decoded to lengths {set(lengths)}, "
                               f"not {prompt} + {new}")
          decode[name].append(time.perf_counter() - t0)
          return state.tokens
        return run

      total = common.time_interleaved({k: rollout(k, e) for k, e in engines.items()}, warmup=1,
                                      repeats=args.repeats)
      med = {k: common.median(v[1:] or v) for k, v in decode.items()}
      row = {"batch": b}
      row.update({f"{k} decode tok/s": b * new / v for k, v in med.items()})
      row["new/old"] = med["old"] / med["new"]
      row["live on/off"] = med["new, live length off"] / med["new"]
      row.update({f"{k} total tok/s": b * new / common.median(v) for k, v in total.items()})
      rows.append(row)
    common.report(f"ab_engine ({args.commit} vs working tree)", rows, args, {"new_tokens": new})


if __name__ == "__main__":
  main()
