"""Placement: the rollout role's devices and mesh in one program, and the weight publish.

``rollout.devices`` (N) gives the in-process rollout engine the first N local devices and the
learner the rest (``split_devices``); ``rollout.mesh`` lays the engine's devices out over the axes
``data`` (slots), ``tensor`` and ``expert`` (``rollout_mesh``), as ``mesh.shape`` does for the
learner's. N = 0 (the default) keeps one device, ``jax.local_devices()[0]``, shared by the engine
and the learner.

A publish (``Learner.policy_params(shardings)``) moves the weights from the learner's layout to
``serving_shardings`` with ``reshard``: device to device, one piece at a time, never through the
host and never a whole array on a device that does not hold all of it in the target layout.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Optional, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from sao_jax.train.distributed import parse_mesh_shape

ROLLOUT_AXES = ("data", "tensor", "expert")


def split_devices(devices: Sequence[Any], num_rollout: int) -> tuple[list, list]:
  """(rollout devices ``devices[:num_rollout]``, training devices: the rest).

  Raises ValueError naming ``rollout.devices`` unless 0 < num_rollout < len(devices)."""
  devices = list(devices)
  if not 0 < num_rollout < len(devices):
    raise ValueError(f"rollout.devices={num_rollout} must be in 1..{len(devices) - 1} "
                     f"({len(devices)} local devices; the rest train); fix: use a smaller "
                     "rollout.devices, or 0 to share device 0 with the learner")
  return devices[:num_rollout], devices[num_rollout:]


def rollout_shape(text: str, num_devices: int) -> dict[str, int]:
  """``rollout.mesh`` ("data=-1,tensor=2") resolved over ``num_devices``: {axis: size} over the
  axes ``ROLLOUT_AXES`` (every one present, in that order; -1 = the remaining devices, '' =
  ``data=-1``).

  Raises ValueError naming ``rollout.mesh`` on an unknown axis, a bad size, or sizes whose
  product is not ``num_devices``."""
  try:
    given = parse_mesh_shape(text or "data=-1")
  except ValueError as e:
    raise ValueError(str(e).replace("mesh.shape", "rollout.mesh")) from None
  fix = (f"fix: give axes {', '.join(ROLLOUT_AXES)} whose sizes multiply to the rollout's "
         f"{num_devices} device(s) (rollout.devices; one size may be -1), e.g. 'data=-1'")
  unknown = [a for a in given if a not in ROLLOUT_AXES]
  if unknown:
    raise ValueError(f"rollout.mesh={text!r}: unknown axis {unknown[0]!r}; {fix}")
  if any(v == 0 or v < -1 for v in given.values()) or list(given.values()).count(-1) > 1:
    raise ValueError(f"rollout.mesh={text!r}: sizes must be >= 1, with at most one -1; {fix}")
  fixed = math.prod(v for v in given.values() if v > 0)
  auto = [a for a, v in given.items() if v == -1]
  if (num_devices % fixed) if auto else fixed != num_devices:
    raise ValueError(f"rollout.mesh={text!r}: needs {fixed} device(s){' (times -1)' * bool(auto)}"
                     f" but the rollout has {num_devices}; {fix}")
  shape = {a: given.get(a, 1) for a in ROLLOUT_AXES}
  if auto:
    shape[auto[0]] = num_devices // fixed
  return shape


def rollout_mesh(text: str, devices: Sequence[Any]) -> Mesh:
  """The engine's mesh over ``devices`` with ``rollout_shape(text, len(devices))``: axes
  ``data``, ``tensor``, ``expert`` (sizes of 1 kept). Raises ValueError as ``rollout_shape``."""
  shape = rollout_shape(text, len(devices))
  return Mesh(np.array(list(devices)).reshape(tuple(shape.values())), tuple(shape))


def serving_shardings(params: Any, mesh: Optional[Mesh]) -> Any:
  """The engine's layout of ``params`` (pytree of arrays or ``ShapeDtypeStruct``s): replicated on
  ``mesh`` (``SAOEngine`` splits slots over ``data`` and replicates the weights), or on this
  process's first device when ``mesh`` is None. A tree of shardings like ``params``."""
  if mesh is None:
    one = SingleDeviceSharding(jax.local_devices()[0])
    return jax.tree.map(lambda _: one, params)
  rep = NamedSharding(mesh, PartitionSpec())
  return jax.tree.map(lambda _: rep, params)


def _bounds(idx: tuple, shape: tuple) -> tuple:
  """An index tuple of slices -> ((lo, hi), ...) per dimension, absolute."""
  return tuple(tuple(s.indices(n)[:2]) for s, n in zip(idx, shape))


def _overlap(a: tuple, b: tuple) -> Optional[tuple]:
  """The intersection of two bounds tuples (None when empty)."""
  out = tuple((max(x[0], y[0]), min(x[1], y[1])) for x, y in zip(a, b))
  return None if any(lo >= hi for lo, hi in out) else out


@functools.lru_cache(maxsize=None)
def _zeros_fn(shape: tuple, dtype, device):
  return jax.jit(functools.partial(jax.numpy.zeros, shape, dtype),
                 out_shardings=SingleDeviceSharding(device))


@functools.partial(jax.jit, static_argnums=(1, 2))
def _slice(x, start, limit):  # static bounds: no index crosses from the host
  return jax.lax.slice(x, start, limit)


@functools.partial(jax.jit, static_argnums=2, donate_argnums=0)
def _place(block, piece, start):
  return jax.lax.dynamic_update_slice(block, piece, start)


def _reshard_leaf(x: jax.Array, target) -> jax.Array:
  """``x`` laid out as ``target``, built on each target device from the pieces of ``x``'s shards
  that overlap that device's block: a piece is sliced on the device that holds it, copied device
  to device, and written into the block (in place). An array already laid out as ``target``
  (same blocks on the same devices) is copied shard by shard. Never aliases ``x``'s buffers."""
  shape = x.shape
  if not shape:  # a scalar: every shard is all of it
    src = x.addressable_shards[0].data
    return jax.make_array_from_single_device_arrays(
        shape, target, [jax.device_put(src, d, may_alias=False)
                        for d in target.addressable_devices_indices_map(shape)])
  shards = [(_bounds(s.index, shape), s.data) for s in x.addressable_shards]
  blocks = []
  for device, idx in target.addressable_devices_indices_map(shape).items():
    idx = _bounds(idx, shape)
    block_shape = tuple(hi - lo for lo, hi in idx)
    exact = [d for i, d in shards if i == idx]
    if exact:  # a shard with exactly this block: copied (from this device when it holds one)
      here = [d for d in exact if device in d.devices()]
      blocks.append(jax.device_put((here or exact)[0], device, may_alias=False))
      continue
    block, covered = None, set()
    for i, data in shards:
      part = _overlap(i, idx)
      if part is None or part in covered:
        continue
      covered.add(part)
      if part != i:  # the overlapping piece, sliced where it lies
        data = _slice(data, tuple(lo - o for (lo, _), (o, _) in zip(part, i)),
                      tuple(hi - o for (_, hi), (o, _) in zip(part, i)))
      piece = jax.device_put(data, device)
      if block is None:
        block = _zeros_fn(block_shape, x.dtype, device)()
      block = _place(block, piece, tuple(lo - o for (lo, _), (o, _) in zip(part, idx)))
      del piece, data
    blocks.append(block)
  return jax.make_array_from_single_device_arrays(shape, target, blocks)


def reshard(tree: Any, shardings: Any) -> Any:
  """``tree`` (fully addressable ``jax.Array`` leaves) laid out as ``shardings`` (a tree like it,
  or one sharding for every leaf), device to device: each target device receives the pieces of
  the source shards that overlap its block, so no device ever holds more of an array than its
  target block plus one source piece, and nothing passes through the host (unlike
  ``jax.device_put`` between different device sets and layouts, which gathers such an array on
  the host). The source arrays are left untouched. Raises ValueError for an array that is not
  fully addressable (another process's shards: the multi-process weight sync moves those)."""
  if not isinstance(shardings, jax.sharding.Sharding):
    return jax.tree.map(lambda x, s: reshard(x, s), tree, shardings)
  leaves, treedef = jax.tree.flatten(tree)
  for x in leaves:
    if not (isinstance(x, jax.Array) and x.is_fully_addressable):
      raise ValueError("reshard needs fully addressable jax.Arrays (this process's devices); got "
                       f"{type(x).__name__}{'' if not isinstance(x, jax.Array) else ' spanning processes'}")
  return jax.tree.unflatten(treedef, [_reshard_leaf(x, shardings) for x in leaves])

