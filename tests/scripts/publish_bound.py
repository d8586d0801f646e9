"""Run by tests/unit/rollout/test_placement.py with 8 forced CPU devices: a weight publish from a
learner
sharded over 4 devices (``fsdp=4``) into a 4-device rollout mesh, device to device.

Prints one JSON line per target layout (``placement.serving_shardings``, the engine's layout:
"replicated" over ``data=4``; "tensor": sharded over ``tensor=4``): per device, the bytes live
before the publish, the peak while it runs (sampled after
every device-to-device copy it makes, the moment a piece has arrived beside the block it is
written into) and the bytes of the published copy held there; the largest learner shard of any
array in the serving dtype (the bound's "one piece"); and whether the values equal the cast
params. Host transfers are disallowed (``jax.transfer_guard`` "disallow_explicit") during the
publish, so one through the host raises.
"""
import collections
import json
import os
import sys

import jax
import numpy as np
from jax.sharding import NamedSharding

from sao_jax import build, roles
from sao_jax.rollout import placement
from sao_jax.train.learner import Learner, LearnerConfig

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import sharding_helpers  # noqa: E402  (tests/: the tiny Qwen3)


def device_bytes() -> dict[int, int]:
  """Bytes of the distinct buffers live on each device (an array's shard and a view of it
  share one buffer: counted once)."""
  seen = {}
  for x in jax.live_arrays():
    for s in x.addressable_shards:
      seen[(s.device.id, s.data.unsafe_buffer_pointer())] = s.data.nbytes
  out = collections.Counter()
  for (d, _), b in seen.items():
    out[d] += b
  return out


def main():
  assert len(jax.devices()) == 8
  config = sharding_helpers.arith_config()
  config.rollout.devices, config.mesh.shape = 4, "fsdp=-1"
  config.model.param_dtype = "bfloat16"  # the serving dtype: the master is float32
  config.model.max_seq_len = sharding_helpers.LENGTH
  run = roles.from_config(config)
  train_mesh, rollout_mesh = build.make_meshes(run)
  pg, pp, cg, cp = sharding_helpers.make_models()
  learner = Learner(LearnerConfig.from_run(run), pg, pp, cg, cp, pad_id=0, mesh=train_mesh)
  del pp, cp
  cast = jax.tree.map(lambda x: np.asarray(x, np.float32).astype(jax.numpy.bfloat16),
                      jax.device_get(learner.policy.params))
  piece = max(s.data.nbytes // 2 for x in jax.tree.leaves(learner.policy.params)
              for s in x.addressable_shards)  # the largest shard, in bfloat16
  tensor_mesh = placement.rollout_mesh("tensor=-1", rollout_mesh.devices.flat)
  layouts = {"replicated": placement.serving_shardings(learner.policy.params, rollout_mesh),
             "tensor": placement.serving_shardings(learner.policy.params, tensor_mesh)}
  cast_bytes = collections.Counter()  # the learner's shards per device, in bfloat16
  for s in (s for x in jax.tree.leaves(learner.policy.params) for s in x.addressable_shards):
    cast_bytes[s.device.id] += s.data.nbytes // 2
  del s
  real_put = jax.device_put
  for name, target in layouts.items():
    before = device_bytes()
    peak = collections.Counter(before)
    copies = [0]

    def sampled_put(*args, **kwargs):
      out = real_put(*args, **kwargs)
      copies[0] += 1
      for d, b in device_bytes().items():
        peak[d] = max(peak[d], b)
      return out

    jax.device_put = sampled_put
    try:
      with jax.transfer_guard_host_to_device("disallow_explicit"), \
           jax.transfer_guard_device_to_host("disallow_explicit"):
        served = learner.policy_params(target)
        jax.block_until_ready(served)
    finally:
      jax.device_put = real_put
    held = collections.Counter()
    for s in (s for x in jax.tree.leaves(served) for s in x.addressable_shards):
      held[s.device.id] += s.data.nbytes
    del s
    after = device_bytes()
    ok = all(isinstance(x.sharding, NamedSharding) and x.sharding == s and x.dtype == c.dtype
             and np.array_equal(np.asarray(x, np.float32), np.asarray(c, np.float32))
             for x, s, c in zip(jax.tree.leaves(served), jax.tree.leaves(target),
                                jax.tree.leaves(cast)))
    print(json.dumps({
        "layout": name, "before": dict(before), "peak": dict(peak), "after": dict(after),
        "held": dict(held), "cast": dict(cast_bytes), "piece": piece, "copies": copies[0],
        "equal": ok,
        "total": sum(c.nbytes for c in jax.tree.leaves(cast)),
        "rollout_devices": [d.id for d in rollout_mesh.devices.flat],
        "learner_devices": [d.id for d in train_mesh.devices.flat]}))
    del served


if __name__ == "__main__":
  sys.exit(main())
