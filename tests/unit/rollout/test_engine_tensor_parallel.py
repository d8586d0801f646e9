"""``SAOEngine`` on meshes with ``tensor`` and ``expert`` axes (issue 28): on 8 forced CPU
devices, a tiny Qwen3-MoE (one dense and one MoE layer) served with its weights split over
``tensor`` (heads, KV heads, MLP hidden, vocabulary) and ``expert`` (experts), its KV cache over
KV heads and its slots over ``data`` draws the same tokens, with log-probs within 1e-5, as the
engine on one device: fresh prompts, decode steps, observations appended after a slot's length
(multi-turn) and the JetStream ``generate`` / ``prefill`` / ``insert`` calls. On an abstract
mesh (no devices), Qwen3-30B-A3B's rollout layout and its weights per chip, counted by hand."""

import repo_paths  # tests/repo_paths.py
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from conftest import with_test_xla_flags  # tests/conftest.py
from sao_jax.models import hf, presets
from sao_jax.models.transformer import Transformer
from sao_jax.rollout.engine import SAOEngine

ROOT = repo_paths.ROOT


def test_qwen3_30b_a3b_rollout_layout_on_abstract_mesh():
  cfg = presets.get_preset("qwen3-30b-a3b")  # 32 heads, 4 KV heads of 128, 128 experts
  graphdef = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))[0]
  shapes = hf.param_shapes(cfg)
  mesh = jax.sharding.AbstractMesh((2, 4, 8), ("data", "tensor", "expert"))
  engine = SAOEngine(cfg, graphdef, None, mesh=mesh, max_concurrent_decodes=64)
  sh = engine.param_shardings(shapes)
  layer = {jax.tree_util.keystr(p): str(s.spec)
           for p, s in jax.tree_util.tree_flatten_with_path(sh["layers"][5])[0]}
  assert layer == {
      "['attn']['q_proj']['kernel']": "P(None, 'tensor')",
      "['attn']['k_proj']['kernel']": "P(None, 'tensor')",
      "['attn']['v_proj']['kernel']": "P(None, 'tensor')",
      "['attn']['o_proj']['kernel']": "P('tensor',)",
      "['attn']['q_norm']['scale']": "P()", "['attn']['k_norm']['scale']": "P()",
      "['attn_norm']['scale']": "P()", "['mlp_norm']['scale']": "P()",
      "['mlp']['router']['kernel']": "P(None, 'expert')",
      "['mlp']['gate_proj']": "P('expert', None, 'tensor')",
      "['mlp']['up_proj']": "P('expert', None, 'tensor')",
      "['mlp']['down_proj']": "P('expert', 'tensor')"}
  assert str(sh["embed"]["embedding"].spec) == "P('tensor',)"
  assert str(sh["lm_head"]["kernel"].spec) == "P(None, 'tensor')"
  assert str(engine.state_shardings.cache[0][0].spec) == "P('data', 'tensor')"
  # weights per chip, by hand: per layer attention (q, o 2048 x 4096; k, v 2048 x 512) / 4,
  # experts 3 x 128 x 2048 x 768 / 32, router 2048 x 128 / 8, norms 2 x 2048 + 2 x 128 whole;
  # embedding and LM head 151936 x 2048 each / 4; the final norm whole
  per_layer = ((2 * 2048 * 4096 + 2 * 2048 * 512) / 4 + 3 * 128 * 2048 * 768 / 32
               + 2048 * 128 / 8 + 2 * 2048 + 2 * 128)
  want = 48 * per_layer + 2 * 151936 * 2048 / 4 + 2048
  got = sum(x.size / np.prod([mesh.shape[a] for a in s.spec if a])
            for x, s in zip(jax.tree.leaves(shapes), jax.tree.leaves(sh)))
  assert got == want and round(want / 1e9, 3) == 1.290  # of 30.5e9 weights
  explicit = jax.sharding.AbstractMesh((2, 4, 8), ("data", "tensor", "expert"), axis_types=(
      jax.sharding.AxisType.Auto,) + (jax.sharding.AxisType.Explicit,) * 2)
  with pytest.raises(ValueError, match=r"rollout.mesh axes \['tensor', 'expert'\] are Explicit"):
    SAOEngine(cfg, graphdef, None, mesh=explicit, max_concurrent_decodes=64)


@pytest.mark.slow  # spawns a process (see pyproject's `slow` marker)
def test_tensor_and_expert_parallel_engine_equals_one_device():
  env = dict(os.environ, XLA_FLAGS=with_test_xla_flags("--xla_force_host_platform_device_count=8"),
             JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "scripts",
                                                      "engine_tensor_parallel.py")],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  r = json.loads(proc.stdout.strip().splitlines()[-1])
  print(r)
  assert r["distinct_tokens"] >= 10  # the toy model samples, it does not repeat one token
  for name in ("tensor=2", "tensor=2,expert=2", "data=2,tensor=2,expert=2"):
    m = r[name]
    # six calls: prefill_insert (fresh), generate_steps, prefill_insert (appended observations),
    # generate_steps, generate, prefill + insert and slot_prefix + prefill + insert then
    # generate_steps
    assert m["tokens_equal"] == [True] * 6, (name, m)
    assert m["max_logprob_diff"] <= 1e-5 and m["max_cache_diff"] <= 1e-5, (name, m)
    assert m["host_lengths_equal"], (name, m)
    # the layout: KV cache [slots, kv_heads, head_dim, len] split over KV heads (2 -> 1 each)
    # (and slots over data); q_proj [32, 4 heads * 8] by heads; experts [4, 32, 16] over
    # expert, their hidden over tensor; it survives the donated decode calls
    data = "'data', " if name.startswith("data") else "None, "
    assert m["cache_spec"] == m["state_spec_after_steps"] == f"P({data}'tensor')", (name, m)
    assert m["cache_shard_shape"] == [4 if data == "None, " else 2, 1, 8, 33], (name, m)
    assert m["q_spec"] == "P(None, 'tensor')" and m["q_shard_shape"] == [32, 16], (name, m)
    experts = 2 if "expert=2" in name else 4
    assert m["gate_shard_shape"] == [experts, 32, 8], (name, m)
    assert "all-reduce" in m["collectives"], (name, m)  # XLA's partitioner sums the shards
    # a decode step gathers activations only (at most the [4 slots, 40] logits), never a
    # weight (the smallest weight shard here has 512 elements)
    assert m["largest_all_gather"] <= 4 * 40, (name, m)
  # params as they come (uncommitted, replicated) on the 8-device mesh: the same draws
  m = r["data=2,tensor=2,expert=2"]
  assert m["unplaced_tokens_equal"] == [True] * 6 and m["unplaced_max_logprob_diff"] <= 1e-5
  assert "rollout.mesh tensor=4 does not divide the model's 2 KV heads" in r["bad_tensor_error"]
