"""Sampler: decode tokens/s of our JetStream engine (``SAOEngine``) vs Hugging Face ``generate``
(PyTorch CPU) on the same weights, and vs the memory-bandwidth bound.

    python benchmarks/bench_sampler.py [--quick] [--json out.json]

Both sides do the same work per batch size B: prefill B prompts of 16 tokens, then sample
``--new`` tokens per sequence at temperature 1 (HF: ``do_sample=True, top_k=0, top_p=1``,
``min_new_tokens = max_new_tokens``, no EOS stop). Ours: B prefills + inserts into B slots, then
``--new`` ``generate`` calls. tokens/s = B * new / wall time (prefill included on both sides;
"ours decode-only" excludes it). Bound: per decode step the weights plus the KV cache of the
average context must be read once: (weight bytes + KV bytes) / measured bandwidth.
"""

from __future__ import annotations

import tempfile

import common  # pylint: disable=import-error
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sao_jax.models import hf
from sao_jax.models.transformer import ModelConfig, Transformer
from sao_jax.rollout.engine import SAOEngine

PROMPT = 16


def config(quick: bool, new: int) -> ModelConfig:
  if quick:
    return ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                       head_dim=16, d_ff=128, max_seq_len=PROMPT + new, arch="qwen3")
  return ModelConfig(vocab_size=4096, d_model=256, n_layers=4, n_heads=8, n_kv_heads=4,
                     head_dim=32, d_ff=768, max_seq_len=PROMPT + new, arch="qwen3")


def main():
  ap = common.parser(__doc__, malloc_flag=True)
  ap.add_argument("--new", type=int, default=64)
  ap.add_argument("--batches", default="1,8,32,128")
  ap.add_argument("--torch_threads", type=int, default=1)
  args = ap.parse_args()
  malloc_tuned = common.apply_malloc(args)
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  torch.set_num_threads(args.torch_threads)
  new = 4 if args.quick else args.new
  batches = [1, 2] if args.quick else [int(x) for x in args.batches.split(",")]
  repeats = 1 if args.quick else args.repeats
  cfg = config(args.quick, new)
  graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
  params = nnx.to_pure_dict(params)
  with tempfile.TemporaryDirectory() as d:
    hf.save_hf_checkpoint(d, cfg, params)
    peer = transformers.Qwen3ForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
  weight_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
  bw = common.measure_bandwidth(16 << 20 if args.quick else 256 << 20)
  rows, cache_sizes = [], {}
  for b in batches:
    engine = SAOEngine(cfg, graphdef, None, max_concurrent_decodes=b,
                       max_prefill_length=PROMPT, temperature=1.0, seed=0)
    rng = np.random.default_rng(b)
    prompts = rng.integers(0, cfg.vocab_size, (b, PROMPT)).astype(np.int32)
    tprompts = torch.from_numpy(prompts).long()
    decode_only = []

    def ours():
      state = engine.init_decode_state()
      for i in range(b):
        pre = engine.prefill(params=params, padded_tokens=prompts[i], true_length=PROMPT)
        state = engine.insert(pre, state, i)
      jax.block_until_ready(state)
      t0 = __import__("time").perf_counter()
      toks = []
      for _ in range(new):
        state, res = engine.generate(params, state)
        toks.append(res.data)
      jax.block_until_ready(toks)
      decode_only.append(__import__("time").perf_counter() - t0)
      return state.tokens

    def theirs():
      with torch.no_grad():
        return peer.generate(tprompts, attention_mask=torch.ones_like(tprompts),
                             max_new_tokens=new, min_new_tokens=new, do_sample=True, top_k=0,
                             top_p=1.0, temperature=1.0, pad_token_id=0)

    times = common.time_interleaved({"ours": ours, "hf": theirs}, warmup=1, repeats=repeats)
    cache_sizes[b] = {"generate": engine._generate_jit._cache_size(),  # pylint: disable=protected-access
                      "prefill": engine._prefill_jit._cache_size(),  # pylint: disable=protected-access
                      "insert": engine._insert_jit._cache_size()}  # pylint: disable=protected-access
    mo, mh = common.median(times["ours"]), common.median(times["hf"])
    md = common.median(decode_only[1:] or decode_only)
    avg_ctx = PROMPT + new / 2
    kv_bytes = 2 * cfg.n_layers * b * avg_ctx * cfg.n_kv_heads * cfg.head_dim * 4
    bound = b / ((weight_bytes + kv_bytes) / bw)
    rows.append({"batch": b, "ours tok/s": b * new / mo, "hf tok/s": b * new / mh,
                 "ours/hf": mh / mo, "ours decode-only tok/s": b * new / md,
                 "bound tok/s": bound, "ours decode / bound": b * new / md / bound})
  common.report("sampler", rows, args, {"weight_bytes": weight_bytes, "bandwidth_Bps": bw,
                                        "new_tokens": new, "prompt": PROMPT,
                                        "jit_cache_sizes": cache_sizes,
                                        "host_malloc.keep_freed_memory": malloc_tuned})


if __name__ == "__main__":
  main()
