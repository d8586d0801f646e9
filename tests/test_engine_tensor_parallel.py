"""``SAOEngine`` on meshes with ``tensor`` and ``expert`` axes (issue 28): on 8 forced CPU
devices, a tiny Qwen3-MoE (one dense and one MoE layer) served with its weights split over
``tensor`` (heads, KV heads, MLP hidden, vocabulary) and ``expert`` (experts), its KV cache over
KV heads and its slots over ``data`` draws the same tokens, with log-probs within 1e-5, as the
engine on one device: fresh prompts, decode steps, observations appended after a slot's length
(multi-turn) and the JetStream ``generate`` / ``prefill`` / ``insert`` calls."""

import json
import os
import subprocess
import sys

import pytest

from conftest import with_test_xla_flags  # tests/conftest.py

pytestmark = pytest.mark.slow  # spawns a process (see pyproject's `slow` marker)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_tensor_and_expert_parallel_engine_equals_one_device():
  env = dict(os.environ, XLA_FLAGS=with_test_xla_flags("--xla_force_host_platform_device_count=8"),
             JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "scripts",
                                                      "engine_tensor_parallel.py")],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  r = json.loads(proc.stdout.strip().splitlines()[-1])
  print(r)
  assert r["distinct_tokens"] >= 10  # the toy model samples, it does not repeat one token
  for name in ("tensor=2", "tensor=2,expert=2", "data=2,tensor=2,expert=2"):
    m = r[name]
    # six calls: prefill_insert (fresh), generate_steps, prefill_insert (appended observations),
    # generate_steps, generate, prefill + insert then generate_steps
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
  # params as they come (uncommitted, replicated) on the 8-device mesh: the same draws
  m = r["data=2,tensor=2,expert=2"]
  assert m["unplaced_tokens_equal"] == [True] * 6 and m["unplaced_max_logprob_diff"] <= 1e-5
  assert "rollout.mesh tensor=4 does not divide the model's 2 KV heads" in r["bad_tensor_error"]
