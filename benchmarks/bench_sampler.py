"""Sampler: tokens/s of our JetStream engine (``SAOEngine``) vs Hugging Face ``generate``
(PyTorch CPU) and Tunix's JAX sampler (``tunix.generate.sampler.Sampler``) on the same weights,
and vs the memory-bandwidth bound.

    python benchmarks/bench_sampler.py [--quick] [--batches 1,8,32,128] [--engine_devices 1,2]
                                       [--json out.json]

Tunix (``google-tunix==0.1.7``) is measured when it imports; it pins ``transformers==5.12.1``,
so it is kept out of the project venv: ``pip install --target DIR --no-deps google-tunix==0.1.7``
plus the modules it imports (einops jaxtyping wadler_lindig qwix google_metrax sentencepiece
perfetto pandas), then run with ``PYTHONPATH=$PWD:DIR``.

All do the same work per batch size B: prefill B prompts of 16 tokens, then produce ``--new``
tokens per sequence (no EOS stop). Ours: one batched ``prefill_insert`` of the B prompts, then
``--new / --decode_steps`` calls of ``generate_steps`` (``--decode_steps`` tokens per call),
sampling at temperature 1 with log-probs, on an engine mesh of each of ``--engine_devices`` host
devices (default 1 and the core count; the slots split over them, ``SAOEngine(mesh=)``; the
faster one counts, as HF's thread count does): the process is started with
``--xla_force_host_platform_device_count`` = the core count unless ``XLA_FLAGS`` sets one;
"ours_api": the JetStream-API path in the same run on one device (B one-row ``prefill`` +
``insert`` calls, then ``--new`` one-step ``generate`` calls), the A/B of those two changes. HF:
at each of ``--torch_threads`` (default 1 and 2; the faster one counts), ``do_sample=True, top_k=0,
top_p=1``, ``min_new_tokens = max_new_tokens``. Tunix: one ``Sampler.__call__`` (prefill + a
compiled decode loop), cache of ``16 + new`` positions, at temperature 1 with ``top_p=1.0``, no
top-k and ``return_logprobs=True`` -- the same work as ours (with top_p 1 and no top-k Tunix 0.1.7
skips its vocabulary sort and draws with ``jax.random.categorical``); "ours/tunix" compares these.
Both again in greedy mode ("ours_greedy" = the engine at temperature 0 on its faster device
count, "tunix_greedy"), each side's cheapest. tokens/s = B * new / wall time (prefill included
for every peer; "ours decode-only" excludes it). Bound: per decode step the weights plus the KV
cache of the average context must be read once: (weight bytes + KV bytes) / measured bandwidth
(every core reading, ``common.measure_bandwidth``). Roofline: the lower of that and the compute
bound, measured matmul FLOP/s / FLOPs per token (2 per weight + attention over the average
context): on a CPU with cache-resident weights a decode step is compute-bound. Peers run
interleaved in one process; medians.
"""

from __future__ import annotations

import tempfile

import common  # pylint: disable=import-error

common.one_xla_device_per_core()  # before JAX starts
import jax  # pylint: disable=wrong-import-position
import numpy as np
from flax import nnx

from sao_jax.models import hf
from sao_jax.models.transformer import ModelConfig, Transformer
from sao_jax.rollout.engine import SAOEngine

PROMPT = 16


def config(quick: bool, new: int, model: str = "small") -> ModelConfig:
  """The benchmark's model: "small" (d256, L4, V4096: the default), "tiny" (the CPU task's
  ``configs/arith_tool.py`` shapes: d128, L2, V104); quick = a d64 toy."""
  if model == "tiny" and not quick:
    return ModelConfig(vocab_size=104, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2,
                       head_dim=32, d_ff=384, max_seq_len=PROMPT + new, arch="qwen3")
  if quick:
    return ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                       head_dim=16, d_ff=128, max_seq_len=PROMPT + new, arch="qwen3")
  return ModelConfig(vocab_size=4096, d_model=256, n_layers=4, n_heads=8, n_kv_heads=4,
                     head_dim=32, d_ff=768, max_seq_len=PROMPT + new, arch="qwen3")


class _IdTokenizer:
  """Tunix's tokenizer protocol over space-separated token ids (pad 0, no bos)."""

  def encode(self, text):
    return [int(x) for x in text.split()]

  def decode(self, ids):
    return " ".join(str(int(i)) for i in ids)

  def bos_id(self):
    return 0

  def eos_id(self):
    return -1

  def pad_id(self):
    return 0


def tunix_peer(cfg: ModelConfig, hf_dir: str, new: int):
  """Returns ``run(prompts int [B, PROMPT]) -> tokens`` with Tunix's sampler on the HF folder's
  weights, or None when tunix does not import."""
  try:
    from tunix.generate import sampler as tsampler  # pylint: disable=import-outside-toplevel
    from tunix.models.qwen3 import params as tparams  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    print(f"tunix not measured: {e}")
    return None
  tcfg = common.tunix_qwen3_config(cfg)
  model = tparams.create_model_from_safe_tensors(hf_dir, tcfg)
  sampler = tsampler.Sampler(model, _IdTokenizer(), tsampler.CacheConfig(
      cache_size=PROMPT + new, num_layers=cfg.n_layers, num_kv_heads=cfg.n_kv_heads,
      head_dim=cfg.head_dim))

  def run(prompts, greedy=False):
    # sampling: temperature 1, top_p 1.0 and no top_k, so Tunix skips its sort and draws with
    # jax.random.categorical; log-probs returned -- the work our engine does per token
    mode = {"temperature": 0.0} if greedy else {"temperature": 1.0, "top_p": 1.0, "top_k": None,
                                                 "return_logprobs": True, "seed": 0}
    out = sampler([" ".join(map(str, p)) for p in prompts], max_generation_steps=new,
                  max_prompt_length=PROMPT, eos_tokens=[cfg.vocab_size], **mode)
    return out.tokens

  return run


def main():
  ap = common.parser(__doc__, malloc_flag=True)
  ap.add_argument("--new", type=int, default=64)
  ap.add_argument("--batches", default="1,8,32,128")
  ap.add_argument("--torch_threads", default="1,2",
                  help="PyTorch thread counts HF runs with (each a peer); ours/hf is against the "
                       "fastest of them at each batch size")
  ap.add_argument("--engine_devices", default=f"1,{len(jax.devices())}",
                  help="host devices the engine splits its slots over (each a variant of ours); "
                       "ours/hf is the fastest of them at each batch size")
  ap.add_argument("--no_tunix", action="store_true")
  ap.add_argument("--decode_steps", type=int, default=8, help="tokens per generate_steps call")
  ap.add_argument("--model", default="small", choices=("small", "tiny", "smollm2"),
                  help="smollm2: the packaged SmolLM2-135M-Instruct GGUF (Llama; Tunix's Qwen3 "
                       "loader does not take it, so HF only)")
  args = ap.parse_args()
  malloc_tuned = common.apply_malloc(args)
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  torch_threads = [int(x) for x in args.torch_threads.split(",")]
  new = 4 if args.quick else args.new
  batches = [1, 2] if args.quick else [int(x) for x in args.batches.split(",")]
  repeats = 1 if args.quick else args.repeats
  if args.model == "smollm2":
    from sao_jax.models import gguf_loader  # pylint: disable=import-outside-toplevel
    cfg, params = gguf_loader.load_gguf(gguf_loader.resolve_gguf_path("smollm2"),
                                        max_seq_len=PROMPT + new)
    graphdef = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))[0]
    args.no_tunix = True
  else:
    cfg = config(args.quick, new, args.model)
    graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
    params = nnx.to_pure_dict(params)
  with tempfile.TemporaryDirectory() as d:
    hf.save_hf_checkpoint(d, cfg, params)
    peer = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    tunix_run = None if args.no_tunix else tunix_peer(cfg, d, new)
  weight_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
  bw = common.measure_bandwidth(16 << 20 if args.quick else 256 << 20)
  flops = common.measure_matmul_flops(256 if args.quick else 1024)
  rows, cache_sizes = [], {}
  engine_devices = sorted({int(x) for x in args.engine_devices.split(",")})
  if args.quick:  # batches 1 and 2: one device and (where there are 2) two
    engine_devices = sorted({1, min(2, len(jax.devices()))})
  for b in batches:
    engines = {}  # devices -> (engine, params on its mesh)
    for d in engine_devices:
      if b % d == 0 and d <= len(jax.devices()):
        mesh = jax.sharding.Mesh(np.array(jax.devices()[:d]), ("data",))
        engines[d] = (SAOEngine(cfg, graphdef, None, max_concurrent_decodes=b,
                                max_prefill_length=PROMPT, temperature=1.0, seed=0, mesh=mesh),
                      jax.device_put(params, jax.sharding.NamedSharding(
                          mesh, jax.sharding.PartitionSpec())))
    engine = engines[min(engines)][0]  # the JetStream-API path runs on one device
    rng = np.random.default_rng(b)
    prompts = rng.integers(1, cfg.vocab_size, (b, PROMPT)).astype(np.int32)  # 0: Tunix's pad
    tprompts = torch.from_numpy(prompts).long()
    decode_only = {d: [] for d in engines}

    steps = max(1, min(args.decode_steps, new))
    if new % steps:
      raise ValueError(f"--new={new} must be a multiple of --decode_steps={steps}")

    def ours(d, temperature=None):
      eng, p = engines[d]
      state, _, _ = eng.prefill_insert(p, eng.init_decode_state(), range(b), prompts,
                                       temperature)
      jax.block_until_ready(state)
      t0 = __import__("time").perf_counter()
      toks = []
      for _ in range(new // steps):
        state, tok, _ = eng.generate_steps(p, state, steps, temperature)
        toks.append(tok)  # (generate_steps returns host arrays: every call syncs, as in a rollout)
      if temperature is None:
        decode_only[d].append(__import__("time").perf_counter() - t0)
      return state.tokens

    def ours_api():
      state = engine.init_decode_state()
      for i in range(b):
        pre = engine.prefill(params=params, padded_tokens=prompts[i], true_length=PROMPT)
        state = engine.insert(pre, state, i)
      toks = []
      for _ in range(new):
        state, res = engine.generate(params, state)
        toks.append(np.asarray(res.data))  # the worker reads every step's tokens
      return state.tokens

    def theirs(threads):
      torch.set_num_threads(threads)
      with torch.no_grad():
        return peer.generate(tprompts, attention_mask=torch.ones_like(tprompts),
                             max_new_tokens=new, min_new_tokens=new, do_sample=True, top_k=0,
                             top_p=1.0, temperature=1.0, pad_token_id=0)

    peers = {}
    for d in engines:
      peers[f"ours@{d}"] = lambda d=d: ours(d)
      peers[f"ours_greedy@{d}"] = lambda d=d: ours(d, 0.0)
    peers["ours_api"] = ours_api
    peers.update({f"hf{n}": (lambda n=n: theirs(n)) for n in torch_threads})
    if tunix_run is not None:
      peers["tunix"] = lambda: tunix_run(prompts)
      peers["tunix_greedy"] = lambda: tunix_run(prompts, greedy=True)
    times = common.time_interleaved(peers, warmup=1, repeats=repeats)
    ours_t = {d: common.median(times[f"ours@{d}"]) for d in engines}
    dev = min(ours_t, key=ours_t.get)
    times["ours"] = times[f"ours@{dev}"]
    times["ours_greedy"] = min((times[f"ours_greedy@{d}"] for d in engines), key=common.median)
    cache_sizes[b] = {"generate": engine._generate_jit._cache_size(),  # pylint: disable=protected-access
                      "prefill": engine._prefill_jit._cache_size(),  # pylint: disable=protected-access
                      "insert": engine._insert_jit._cache_size(),  # pylint: disable=protected-access
                      "prefill_insert": engine._prefill_insert_jit._cache_size(),  # pylint: disable=protected-access
                      "generate_steps": engine._generate_steps_jit._cache_size()}  # pylint: disable=protected-access
    hf_t = {n: common.median(times[f"hf{n}"]) for n in torch_threads}
    best = min(hf_t, key=hf_t.get)
    mo, mh = common.median(times["ours"]), hf_t[best]
    md = common.median(decode_only[dev][1:] or decode_only[dev])
    avg_ctx = PROMPT + new / 2
    kv_bytes = 2 * cfg.n_layers * b * avg_ctx * cfg.n_kv_heads * cfg.head_dim * 4
    bound = b / ((weight_bytes + kv_bytes) / bw)
    # compute side: 2 FLOPs per weight per token (embedding gather excluded, tied LM head
    # included) + q.k and p.v over the average context
    n_weights = sum(x.size for x in jax.tree.leaves(params))
    tok_flops = 2 * n_weights + 4 * cfg.n_layers * avg_ctx * cfg.n_heads * cfg.head_dim
    roofline = min(bound, flops / tok_flops)
    ma = common.median(times["ours_api"])
    row = {"batch": b, "ours tok/s": b * new / mo, "ours devices": dev,
           **{f"ours@{d} tok/s": b * new / t for d, t in ours_t.items()},
           "ours_api tok/s": b * new / ma,
           "ours/ours_api": ma / mo, "hf tok/s": b * new / mh, "hf threads": best,
           "ours/hf": mh / mo}
    if "tunix" in times:
      mt = common.median(times["tunix"])
      mtg, mog = common.median(times["tunix_greedy"]), common.median(times["ours_greedy"])
      row.update({"tunix tok/s": b * new / mt, "ours/tunix": mt / mo,
                  "tunix_greedy tok/s": b * new / mtg, "ours_greedy/tunix_greedy": mtg / mog})
    row.update({"ours decode-only tok/s": b * new / md, "bound tok/s": bound,
                "ours decode / bound": b * new / md / bound,
                "compute bound tok/s": flops / tok_flops,
                "ours decode / roofline": b * new / md / roofline})
    rows.append(row)
  label = "quick: a d64 toy, a wiring check, numbers not meaningful" if args.quick else args.model
  common.report(f"sampler ({label})", rows, args, {"model": "quick" if args.quick else args.model,
                                        "weight_bytes": weight_bytes, "bandwidth_Bps": bw,
                                        "matmul_flops": flops,
                                        "new_tokens": new, "prompt": PROMPT,
                                        "decode_steps": max(1, min(args.decode_steps, new)),
                                        "jit_cache_sizes": cache_sizes,
                                        "host_malloc.keep_freed_memory": malloc_tuned})


if __name__ == "__main__":
  main()
