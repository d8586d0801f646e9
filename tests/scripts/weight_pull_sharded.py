"""Run with 4 forced CPU devices (``tests/unit/rollout/test_weight_pull.py``): a receiver whose
parameters
are laid out over a 2 x 2 ``(data, tensor)`` mesh (one leaf split over ``tensor``, one over both
axes, one replicated) pulls a published version by ``jax.experimental.transfer`` in buckets.
Prints one JSON line of what it measured; the test asserts on it."""

import json

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from sao_jax.rollout.weight_sync import WeightPublisher, WeightPuller


def main():
  rng = np.random.default_rng(0)
  tree = {"b": jnp.asarray(rng.normal(size=10), jnp.bfloat16),
          "e": jnp.asarray(rng.normal(size=(8, 8)), jnp.float32),
          "w": jnp.asarray(rng.normal(size=(6, 8)), jnp.float32)}
  mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "tensor"))
  specs = {"b": P(), "e": P("data", "tensor"), "w": P(None, "tensor")}
  shardings = [NamedSharding(mesh, specs[k]) for k in sorted(tree)]  # treedef order: b, e, w
  pub = WeightPublisher("transfer", ip="127.0.0.1", bucket_bytes=100)
  pub.publish(tree, 1)
  puller = WeightPuller(shardings)
  ref = pub.ref_for(puller.layout(pub._avals))  # pylint: disable=protected-access
  got = puller.pull(ref, expected=tree)
  pub.bucket_bytes = 0  # the same version's tree in one bucket
  one_ref = pub.ref_for(puller.layout(pub._avals))  # pylint: disable=protected-access
  one = WeightPuller(shardings).pull(one_ref)

  def bits(x):
    return np.asarray(x).view(np.uint8).tobytes()

  print(json.dumps({
      "buckets": len(ref.buckets), "one_ref_buckets": len(one_ref.buckets),
      "piece_shapes": [[[b - a for a, b in box] for _, box in bucket] for bucket in ref.buckets],
      "piece_bytes": ref.piece_bytes, "tree_bytes": ref.nbytes,
      "equal_tree": {k: bits(got[k]) == bits(tree[k]) for k in tree},
      "equal_one_bucket": {k: bits(got[k]) == bits(one[k]) for k in tree},
      "specs": {k: str(got[k].sharding.spec) for k in tree},
      "shard_shapes": {k: sorted({tuple(s.data.shape) for s in got[k].addressable_shards})
                       for k in tree},
      "dtypes": {k: str(got[k].dtype) for k in tree}}))


if __name__ == "__main__":
  main()
