"""Subprocess worker of tests/unit/models/test_sharded_load.py (XLA_FLAGS gives 8 CPU devices before
JAX
starts).

``python tests/sharded_load_worker.py DIR OUT.json``: writes a tiny Qwen3-MoE Hugging Face
checkpoint (float32, several safetensors shards) under DIR, then, as the main job does with
``mesh.shape="fsdp=2,tensor=2,expert=2"`` and ``model.param_dtype="bfloat16"``, loads it into
the learner's mesh (``build.build_policy(..., mesh=)``) and builds the learner on it
(``build.make_learner``). Records the bytes each device holds after every tensor is placed, the
values against a one-device load, the shardings, and whether the learner moved any parameter
through the host.
"""

from __future__ import annotations

import gc
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from sao_jax import build, configs, roles  # noqa: E402
from sao_jax.models import hf, presets  # noqa: E402
from sao_jax.models.transformer import Transformer  # noqa: E402
from sao_jax.train import sharding  # noqa: E402
import sharding_helpers as H  # noqa: E402

MESH = "fsdp=2,tensor=2,expert=2"
# the Qwen3-MoE preset widened so that the replicated norms are a small part of the bytes
CFG = presets.get_preset("tiny-qwen3-moe", vocab_size=512, d_model=128, n_heads=4, n_kv_heads=2,
                         head_dim=32, moe_d_ff=64, n_experts=8, max_seq_len=32)


def live_bytes_per_device() -> dict:
  """Bytes each device holds in all live arrays, each buffer once (``jax.live_arrays`` lists a
  global array and the single-device arrays it was assembled from, which share buffers)."""
  seen, out = set(), {}
  for a in jax.live_arrays():
    for shard in a.addressable_shards:
      key = (shard.device, shard.data.unsafe_buffer_pointer())
      if key not in seen:
        seen.add(key)
        out[shard.device] = out.get(shard.device, 0) + shard.data.nbytes
  return out


def flat(tree):
  return {"/".join(str(getattr(k, "key", k)) for k in p): x
          for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def main(ckpt, out_path):
  assert jax.device_count() == 8, jax.devices()
  params = nnx.to_pure_dict(nnx.split(Transformer(CFG, rngs=nnx.Rngs(0)))[1])
  files = hf.save_hf_checkpoint(ckpt, CFG, params, max_shard_bytes=600_000)
  del params
  gc.collect()  # the module's reference cycles would keep its arrays live
  assert not jax.live_arrays()

  # every array placed through make_array_from_callback: the loader's tensors, the learner's
  # host path; after each, the bytes each device holds of all live arrays
  log = {"placed": 0, "max_device_bytes": 0, "max_array_device_bytes": 0}
  original = jax.make_array_from_callback

  def tracked(shape, s, callback, *args, **kwargs):
    arr = original(shape, s, callback, *args, **kwargs)
    log["placed"] += 1
    log["max_array_device_bytes"] = max(log["max_array_device_bytes"],
                                        max(H.bytes_per_device([arr]).values()))
    log["max_device_bytes"] = max(log["max_device_bytes"], max(live_bytes_per_device().values()))
    return arr

  jax.make_array_from_callback = tracked
  config = configs.load("arith_tool")
  config.model.checkpoint_dir = ckpt
  config.model.param_dtype = config.model.dtype = "bfloat16"
  config.model.max_seq_len = 32
  config.mesh.shape = MESH
  config = roles.from_config(config)
  mesh = build.make_mesh(config.mesh)
  policy = build.build_policy(config, task=None, mesh=mesh)
  load = dict(log)
  total = H.total_bytes(policy.params)
  per_device = H.bytes_per_device(policy.params)
  want = sharding.param_shardings(policy.params, mesh)
  same_shardings = all(x.sharding == s for x, s in zip(jax.tree.leaves(policy.params),
                                                       jax.tree.leaves(want)))

  # the same checkpoint on one device, the pre-existing path
  _, ref = hf.load_hf_checkpoint(ckpt, max_seq_len=32, dtype="bfloat16", param_dtype="bfloat16")
  one_device = max(H.bytes_per_device(ref).values()) / total
  ref = {k: np.asarray(v) for k, v in flat(ref).items()}
  got = {k: np.asarray(v) for k, v in flat(policy.params).items()}
  values_equal = got.keys() == ref.keys() and all(
      got[k].dtype == ref[k].dtype and np.array_equal(got[k], ref[k]) for k in ref)

  _, critic = build.critic_from_policy(policy.mcfg, policy.params, 1)
  backbone = flat(critic["backbone"])
  critic_in_place = all(
      backbone[k].sharding == x.sharding and np.array_equal(np.asarray(backbone[k]), ref[k])
      and backbone[k] is not x for k, x in flat(policy.params).items())
  del critic, backbone

  log["placed"] = 0
  learner = build.make_learner(config, policy, pad_id=0, mesh=mesh)
  learner_host_placements = log["placed"]
  master = {k: np.asarray(v) for k, v in flat(learner.policy.params).items()}
  critic_master = {k: np.asarray(v) for k, v in flat(learner.critic.params["backbone"]).items()}
  learner_values_equal = all(
      master[k].dtype == np.float32 and np.array_equal(master[k], ref[k].astype(np.float32))
      and np.array_equal(critic_master[k], master[k]) for k in ref)
  learner_same_shardings = all(
      a.sharding.spec == b.sharding.spec for a, b in
      zip(jax.tree.leaves(learner.policy.params), jax.tree.leaves(policy.params)))
  states = H.bytes_per_device([learner.states()])
  json.dump({
      "devices": jax.device_count(), "files": len(files), "total_bytes": total,
      "tensors_placed": load["placed"],
      "max_fraction_during_load": load["max_device_bytes"] / total,
      "max_array_fraction": load["max_array_device_bytes"] / total,
      "max_fraction_loaded": max(per_device.values()) / total,
      "min_fraction_loaded": min(per_device.values()) / total,
      "one_device_load_fraction": one_device, "same_shardings": same_shardings,
      "values_equal": values_equal,
      "critic_in_place": critic_in_place, "learner_host_placements": learner_host_placements,
      "learner_values_equal": learner_values_equal,
      "learner_same_shardings": learner_same_shardings,
      "learner_states_max_over_min": max(states.values()) / min(states.values()),
      "expert_spec": str(policy.params["layers"][0]["mlp"]["gate_proj"].sharding.spec),
  }, open(out_path, "w"), indent=1)


if __name__ == "__main__":
  main(sys.argv[1], sys.argv[2])
