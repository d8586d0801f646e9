"""Weights pulled in buckets, on the actor's own thread (``rollout/weight_sync.py``,
``rollout/ray_actor.py``, ``rollout/ray_source.py``): a bucketed pull equals the whole-tree
pull bit for bit (both transports; a tensor-sharded receiver pulls only its slices), an actor
keeps delivering trajectories while a pull is held half-way, and the trainer's ``publish``
returns while an actor's pull is held.

The Ray tests share ``tests/integration/test_ray_source.py``'s local cluster fixture (127.0.0.1, no
process
left) and its pull gate (``PULL_GATE``: a file whose presence holds every pull before its second
bucket)."""

import repo_paths  # tests/repo_paths.py
import json
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import with_test_xla_flags  # tests/conftest.py
from sao_jax import roles
from sao_jax.rollout.weight_sync import WeightPublisher, WeightPuller
from test_ray_source import PULL_GATE, _config, ray_cluster  # noqa: F401  (the fixture)

pytestmark = pytest.mark.slow  # every test here is slow (see pyproject's `slow` marker)

ROOT = repo_paths.ROOT


def _tree():
  rng = np.random.default_rng(0)
  return {"embed": jnp.asarray(rng.normal(size=(50, 16)), jnp.bfloat16),
          "blocks": {"w": jnp.asarray(rng.normal(size=(16, 24)), jnp.float32),
                     "b": jnp.asarray(rng.normal(size=(24,)), jnp.float32)},
          "head": jnp.asarray(rng.normal(size=(16, 50)), jnp.float32)}


def _bits(x) -> bytes:
  return np.asarray(x).view(np.uint8).tobytes()


def _pull_both_ways(transport: str):
  """The same version pulled in buckets of 512 bytes and in one bucket."""
  tree = _tree()
  pub = WeightPublisher(transport, ip="127.0.0.1", bucket_bytes=512)
  pub.publish(tree, 1)
  bucketed_ref = pub.ref_for()
  bucketed = WeightPuller().pull(bucketed_ref, expected=tree)
  pub.bucket_bytes = 0
  pub.publish(tree, 2)  # object store: the buckets are cut at publish
  whole_ref = pub.ref_for()
  whole = WeightPuller().pull(whole_ref, expected=tree)
  return tree, bucketed_ref, bucketed, whole_ref, whole


def _check_equal(transport):
  tree, bucketed_ref, bucketed, whole_ref, whole = _pull_both_ways(transport)
  # the tree is 50*16*2 + 16*24*4 + 24*4 + 16*50*4 = 6432 bytes: leaves of 96, 1536, 1600, 3200
  # bytes (treedef order blocks.b, blocks.w, embed, head); 512-byte buckets: each leaf alone
  # (96 + 1536 > 512; a leaf over the budget is a bucket of its own); whole tree: one bucket
  assert bucketed_ref.nbytes == 6432 and len(bucketed_ref.buckets) == 4
  assert [[i for i, _ in b] for b in bucketed_ref.buckets] == [[0], [1], [2], [3]]
  assert len(whole_ref.buckets) == 1
  for a, b, t in zip(jax.tree.leaves(bucketed), jax.tree.leaves(whole), jax.tree.leaves(tree)):
    assert a.dtype == b.dtype == t.dtype and a.shape == t.shape
    assert _bits(a) == _bits(b) == _bits(t)
  assert jax.tree.structure(bucketed) == jax.tree.structure(tree)


def test_bucketed_transfer_pull_equals_the_whole_tree_pull_bit_for_bit():
  _check_equal("transfer")


def test_bucketed_object_store_pull_equals_the_whole_tree_pull_bit_for_bit(ray_cluster):  # noqa: F811
  _check_equal("object_store")


def test_a_tensor_sharded_receiver_pulls_each_of_its_slices_once():
  """4 forced devices, a (data=2, tensor=2) receiver mesh: every piece moved is one shard's
  slice (never a whole split leaf onto one device), a slice replicated over ``data`` moves once
  (bytes moved = tree bytes), and the result, laid out as asked, equals the tree bit for bit in
  100-byte buckets and in one bucket."""
  env = dict(os.environ, XLA_FLAGS=with_test_xla_flags("--xla_force_host_platform_device_count=4"),
             JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "scripts",
                                                      "weight_pull_sharded.py")],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  r = json.loads(proc.stdout.strip().splitlines()[-1])
  print(r)
  # b: bf16[10] replicated (20 bytes); e: f32[8, 8] over (data, tensor): four [4, 4] slices of
  # 64 bytes; w: f32[6, 8] over tensor: two [6, 4] slices of 96 bytes, each held by 2 devices
  assert r["piece_shapes"] == [[[10], [4, 4]], [[4, 4]], [[4, 4]], [[4, 4]], [[6, 4]], [[6, 4]]]
  assert r["piece_bytes"] == r["tree_bytes"] == 20 + 256 + 192
  assert r["buckets"] == 6 and r["one_ref_buckets"] == 1
  assert r["equal_tree"] == r["equal_one_bucket"] == {"b": True, "e": True, "w": True}
  assert r["specs"] == {"b": "P()", "e": "P('data', 'tensor')", "w": "P(None, 'tensor')"}
  assert r["shard_shapes"] == {"b": [[10]], "e": [[4, 4]], "w": [[6, 4]]}
  assert r["dtypes"] == {"b": "bfloat16", "e": "float32", "w": "float32"}


def test_an_actor_delivers_trajectories_while_it_pulls_and_publish_never_waits(ray_cluster):  # noqa: F811
  """One Ray actor, weights in buckets of ~4 KB: a pull of version 1 is held after its first
  bucket (the gate). Meanwhile (c) ``publish`` of version 2 returns with the actor still on
  version 0, mid-pull; (a) trajectories keep arriving, all sampled by version 0. Once the gate
  opens, the held pull finishes and the actor ends on version 2 (the newest, after the older
  pull completed); trajectories then carry the new versions, never decreasing within one."""
  from sao_jax import tasks  # pylint: disable=import-outside-toplevel
  from sao_jax.models.transformer import Transformer  # pylint: disable=import-outside-toplevel
  from sao_jax.pretrained import model_config  # pylint: disable=import-outside-toplevel
  from sao_jax.rollout.ledger import PromptLedger  # pylint: disable=import-outside-toplevel
  from sao_jax.rollout.ray_source import RaySource  # pylint: disable=import-outside-toplevel
  c = _config()
  c.rollout.num_workers = 1
  c.rollout.weight_bucket_mb = 4096 / 2 ** 20
  config = roles.from_config(c)
  task = tasks.make_task(config)
  mcfg = model_config(config.model, task.tokenizer.vocab_size)
  params = nnx.to_pure_dict(nnx.split(Transformer(mcfg, rngs=nnx.Rngs(0)))[1])
  source = RaySource(config, mcfg, PromptLedger(task.train_problems, seed=0), params, version=0)
  actor = source.actors[0]
  try:
    assert len(source.take(2, policy_version=0)) == 2  # serving version 0
    with open(PULL_GATE, "w", encoding="utf-8"):
      pass
    source.publish(jax.tree.map(lambda x: x + 0.01, params), 1)
    during = []
    deadline = time.time() + 120
    while not (actor.pulling == 1 and actor.buckets_done >= 1) and time.time() < deadline:
      during += source.take(1, policy_version=1)
    assert actor.pulling == 1 and actor.buckets_done >= 1, "the pull of version 1 never started"
    n_buckets = len(actor.pull_wref.buckets)
    assert n_buckets >= 3, n_buckets
    # (c) the trainer's publish returns while the actor's pull is held half-way
    source.publish(jax.tree.map(lambda x: x + 0.02, params), 2)
    assert actor.version == 0 and actor.pulling == 1 and actor.buckets_done < n_buckets
    # (a) trajectories keep arriving meanwhile, all sampled by version 0
    while len(during) < 6 and time.time() < deadline:
      during += source.take(1, policy_version=2)
    assert len(during) >= 6
    assert actor.version == 0 and actor.pulling == 1 and actor.buckets_done < n_buckets
    for t in during:
      acts = t.action_mask > 0
      assert int(t.policy_version[acts].max()) == 0
  finally:
    if os.path.exists(PULL_GATE):
      os.remove(PULL_GATE)
  try:
    after = []
    deadline = time.time() + 120
    while (actor.version < 2 or not any(int(t.policy_version.max()) >= 1 for t in after)) \
        and time.time() < deadline:
      after += source.take(1, policy_version=2)
    assert actor.version == 2 and actor.pulling == -1
    assert any(int(t.policy_version.max()) >= 1 for t in after)  # the worker switched
    for t in during + after:
      v = t.policy_version[t.action_mask > 0]
      assert np.all(np.diff(v) >= 0)  # one trajectory: versions never go back
  finally:
    source.close()
