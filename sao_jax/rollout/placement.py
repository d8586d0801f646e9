"""Rollout and training on disjoint sub-meshes of one program, weights synced by resharding.

``split_devices(devices, num_rollout)`` gives the engine the first ``num_rollout`` devices and the
trainer the rest (a configurable rollout : training device ratio). ``ReshardingWeightStore``
publishes the trainer's params with ``jax.device_put`` to the engine's sharding, so the engine's
jitted prefill / generate never touch the trainer's devices and the trainer never waits for them.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sao_jax.rollout.sync import WeightStore


def split_devices(devices: Sequence[Any], num_rollout: int) -> tuple[Mesh, Mesh]:
  """(engine mesh over ``devices[:num_rollout]``, trainer mesh over the rest), axis "data".

  Raises ValueError unless 0 < num_rollout < len(devices)."""
  devices = list(devices)
  if not 0 < num_rollout < len(devices):
    raise ValueError(f"rollout.num_devices={num_rollout} must be in 1..{len(devices) - 1} "
                     f"({len(devices)} devices: the rest train).")
  return (Mesh(np.array(devices[:num_rollout]), ("data",)),
          Mesh(np.array(devices[num_rollout:]), ("data",)))


def replicated(mesh: Mesh) -> NamedSharding:
  """Fully replicated sharding on ``mesh``."""
  return NamedSharding(mesh, PartitionSpec())


class ReshardingWeightStore(WeightStore):
  """``WeightStore`` whose ``publish`` reshards params onto the engine's ``sharding``
  (``jax.device_put``: a device-to-device copy; the trainer's arrays are left untouched)."""

  def __init__(self, params: Any, version: int, sharding):
    self.sharding = sharding
    super().__init__(jax.device_put(params, sharding), version)

  def publish(self, params: Any, version: int) -> None:
    super().publish(jax.device_put(params, self.sharding), version)
