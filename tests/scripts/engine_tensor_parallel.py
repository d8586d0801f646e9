"""Run with 8 forced CPU devices (``tests/unit/rollout/test_engine_tensor_parallel.py``):
``SAOEngine`` on
meshes with ``tensor`` and ``expert`` axes (weights and KV cache split over them, slots over
``data``) against the same engine on one device, call for call, on a tiny Qwen3-MoE. Prints one
JSON line of what it measured; the test asserts on it."""

import json
import re
import sys
import time

import jax
import numpy as np
from flax import nnx

sys.path.insert(0, __file__.rsplit("/scripts/", 1)[0])  # tests/: rollout_fixtures
from rollout_fixtures import Tok  # noqa: E402
from sao_jax.models import presets  # noqa: E402
from sao_jax.models.transformer import Transformer  # noqa: E402
from sao_jax.rollout.engine import SAOEngine  # noqa: E402
from sao_jax.train import sharding  # noqa: E402

# one dense layer (MLP on tensor) and one MoE layer (experts on expert, their hidden on tensor)
CFG = presets.get_preset("tiny-qwen3-moe", vocab_size=40, d_model=32, n_layers=2, n_heads=4,
                         n_kv_heads=2, head_dim=8, d_ff=32, moe_d_ff=16, n_experts=4,
                         n_experts_per_tok=2, moe_layers=(1,), max_seq_len=32)
MESHES = {"tensor=2": {"data": 1, "tensor": 2, "expert": 1},
          "tensor=2,expert=2": {"data": 1, "tensor": 2, "expert": 2},
          "data=2,tensor=2,expert=2": {"data": 2, "tensor": 2, "expert": 2}}
# kv_bucket 32 of a 33-position cache: one live-length bucket, so few compiles
KW = dict(max_concurrent_decodes=4, max_prefill_length=8, temperature=1.0, seed=3, kv_bucket=32)


def calls(engine, params):
  """Fresh prompts, decode, observations appended after two slots' lengths (multi-turn), decode,
  then the JetStream API (generate, prefill + insert, slot_prefix + prefill + insert). Returns
  [(tokens, log-probs)] per call and the final decode state."""
  out, st = [], engine.init_decode_state()
  st, t, l = engine.prefill_insert(params, st, [3, 0, 1], [[1, 2, 3], [4, 5], [6] * 7])
  out.append((t, l))
  st, t, l = engine.generate_steps(params, st, 4)
  out.append((t, l))
  hl = st.host_lengths
  st, t, l = engine.prefill_insert(params, st, [3, 1], [[3, 4, 5], [6, 7]],
                                   starts=[hl[3] - 2, hl[1] - 1])
  out.append((t, l))
  st, t, l = engine.generate_steps(params, st, 4)
  out.append((t, l))
  st, res = engine.generate(params, st)
  out.append((res.data[:, 0], res.logprobs[:, 0]))
  pre = engine.prefill(params=params, padded_tokens=np.array([1, 2, 3, 4, 0, 0, 0, 0], np.int32),
                       true_length=4)
  st = engine.insert(pre, st, 2)
  # multi-turn through the JetStream API: a slot's cache out, a chunk prefilled on it, back in
  cont = engine.prefill(params=params, existing_prefix=engine.slot_prefix(st, 3),
                        padded_tokens=np.array([3, 4, 0, 0, 0, 0, 0, 0], np.int32), true_length=2)
  st = engine.insert(cont, st, 3)
  st, t, l = engine.generate_steps(params, st, 4)
  out.append((t, l))
  return [(np.asarray(t), np.asarray(l)) for t, l in out], st


def main():
  assert len(jax.devices()) == 8
  graphdef, params = nnx.split(Transformer(CFG, rngs=nnx.Rngs(0)))
  params = nnx.to_pure_dict(params)
  # a flatter toy model, so the draws matter
  params["embed"]["embedding"] = params["embed"]["embedding"] * 0.3
  one, st1 = calls(SAOEngine(CFG, graphdef, Tok(), **KW), params)
  result = {"distinct_tokens": len(set(np.concatenate([t.ravel() for t, _ in one]).tolist()))}
  for name, shape in MESHES.items():
    print(f"{time.strftime('%H:%M:%S')} {name}", file=sys.stderr, flush=True)
    n = int(np.prod(list(shape.values())))
    mesh = sharding.make_mesh(shape, devices=jax.devices()[:n])
    engine = SAOEngine(CFG, graphdef, Tok(), mesh=mesh, **KW)
    placed = engine.load_params(params)  # published into the engine's layout
    got, st = calls(engine, placed)
    got_rep = None
    if shape["data"] > 1:  # params as they come (uncommitted, replicated): the same draws
      engine.reseed(KW["seed"])
      got_rep, _ = calls(engine, params)
    gate = placed["layers"][1]["mlp"]["gate_proj"]  # [E, D, F]
    q = placed["layers"][0]["attn"]["q_proj"]["kernel"]  # [D, H * hd]
    k_cache = st.cache[0][0]  # [slots, kv_heads, head_dim, cache_len]
    hlo = engine._generate_steps_jit.lower(  # pylint: disable=protected-access
        placed, st.replace(host_lengths=None), np.float32(1.0), kv_len=engine.cache_len,
        num_steps=2).compile().as_text()
    result[name] = {
        "tokens_equal": [bool(np.array_equal(a[0], b[0])) for a, b in zip(one, got)],
        "max_logprob_diff": max(float(np.abs(a[1] - b[1]).max()) for a, b in zip(one, got)),
        "unplaced_tokens_equal": got_rep and [bool(np.array_equal(a[0], b[0]))
                                              for a, b in zip(one, got_rep)],
        "unplaced_max_logprob_diff": got_rep and max(float(np.abs(a[1] - b[1]).max())
                                                     for a, b in zip(one, got_rep)),
        "max_cache_diff": max(float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in
                              zip(jax.tree.leaves(st1.cache), jax.tree.leaves(st.cache))),
        "host_lengths_equal": st.host_lengths == st1.host_lengths,
        "cache_spec": str(k_cache.sharding.spec),
        "cache_shard_shape": list(k_cache.addressable_shards[0].data.shape),
        "gate_spec": str(gate.sharding.spec),
        "gate_shard_shape": list(gate.addressable_shards[0].data.shape),
        "q_spec": str(q.sharding.spec),
        "q_shard_shape": list(q.addressable_shards[0].data.shape),
        "state_spec_after_steps": str(st.cache[1][1].sharding.spec),
        "collectives": sorted(set(re.findall(
            r"all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter", hlo))),
        # the largest array a decode step all-gathers (elements): activations, never a weight
        "largest_all_gather": max([int(np.prod([int(d) for d in dims.split(",") if d]))
                                   for dims in re.findall(r"\w+\[([\d,]*)\]\{[^}]*\} "
                                                          r"all-gather(?:-start)?\(", hlo)],
                                  default=0)}
  try:
    SAOEngine(CFG, graphdef, Tok(), mesh=sharding.make_mesh(
        {"data": 1, "tensor": 4}, devices=jax.devices()[:4]), **KW)
    result["bad_tensor_error"] = "no error"
  except ValueError as e:
    result["bad_tensor_error"] = str(e)
  print(json.dumps(result))


if __name__ == "__main__":
  sys.exit(main())
