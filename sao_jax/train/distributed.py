"""One program from one CPU to many hosts: ``jax.distributed`` set-up, the rows each process
feeds, micro-batch planning, and the mesh-shape config string.

Multi-controller model (JAX's own runtime): every process runs the same learner
(``sao_jax.train.learner``) on the same config; each feeds only its own rows of the global
batch; scalar metrics come back replicated on every process; only process 0 writes logs
(``train.metrics.make_metric_writer``); orbax checkpoints are written and read by all processes
together.
"""

from __future__ import annotations

import os
from typing import Optional

import jax
import numpy as np
from jax.sharding import NamedSharding

from sao_jax import roles
from sao_jax.rollout.ray_local import is_loopback


_ENV = {"coordinator_address": "JAX_COORDINATOR_ADDRESS", "num_processes": "JAX_NUM_PROCESSES",
        "process_id": "JAX_PROCESS_ID"}


def initialize(dist: Optional[roles.Distributed] = None) -> bool:
  """Starts ``jax.distributed`` from the ``distributed`` role (``roles.Distributed``; None =
  its defaults) and/or the environment.

  Fields (the role's when set, else env ``JAX_COORDINATOR_ADDRESS`` / ``JAX_NUM_PROCESSES`` /
  ``JAX_PROCESS_ID``): ``coordinator_address`` ("host:port"; empty = single process, nothing
  is started), ``num_processes``, ``process_id`` (-1 = unset), ``cpu_collectives`` ("gloo" so
  CPU processes can all-reduce; ignored on GPU/TPU). Must run before any other JAX call. A
  loopback coordinator address (one machine) binds the coordinator to loopback
  (``bind_address``).

  Returns True if ``jax.distributed.initialize`` was called. Raises ValueError if an address
  is given without ``num_processes`` / ``process_id``.
  """
  dist = dist if dist is not None else roles.Distributed()
  get = lambda k: (getattr(dist, k) if getattr(dist, k) not in ("", -1)
                   else os.environ.get(_ENV[k]))
  address = get("coordinator_address")
  if not address:
    return False
  num, pid = get("num_processes"), get("process_id")
  if num is None or pid is None:
    raise ValueError("distributed.coordinator_address is set, so distributed.num_processes and "
                     "distributed.process_id are needed too (or JAX_NUM_PROCESSES / "
                     "JAX_PROCESS_ID).")
  collectives = dist.cpu_collectives
  if collectives:
    jax.config.update("jax_cpu_collectives_implementation", collectives)
  jax.distributed.initialize(coordinator_address=address, num_processes=int(num),
                             process_id=int(pid), coordinator_bind_address=bind_address(address))
  return True


def bind_address(coordinator_address: str) -> Optional[str]:
  """Where process 0's coordinator service listens: ``127.0.0.1:<port>`` (``[::1]:<port>``)
  when ``coordinator_address`` names a loopback host (``localhost``, 127.x, ::1: every process
  on this machine), so a one-machine job opens no port to the network; otherwise None (JAX's
  default: every interface, or ``JAX_COORDINATOR_BIND_ADDRESS`` when set)."""
  if os.environ.get("JAX_COORDINATOR_BIND_ADDRESS"):
    return None
  host, _, port = coordinator_address.rpartition(":")
  if not is_loopback(host):
    return None
  return f"[::1]:{port}" if host.strip("[]") == "::1" else f"127.0.0.1:{port}"


def is_main_process() -> bool:
  """True on process 0 (the one that writes logs and summaries)."""
  return jax.process_index() == 0


def microbatch_plan(batch_size: int, row_len: int, tokens_per_device: int,
                    batch_shards: int) -> tuple[int, int]:
  """How many rows and micro-batches a step needs so each device sees at most
  ``tokens_per_device`` padded tokens per micro-batch.

  Rows per micro-batch R = ``batch_shards * max(1, tokens_per_device // row_len)``; micro-batches
  M = ceil(batch_size / R); the batch is padded with empty rows to M * R (empty rows have no
  action tokens, so they change no loss, gradient or metric). ``tokens_per_device <= 0`` means
  no limit (one micro-batch, rows rounded up to a multiple of ``batch_shards``).

  Returns ``(padded_rows, microbatches)``. Raises ValueError on non-positive sizes.
  """
  for name, v in (("batch_size", batch_size), ("row_len", row_len),
                  ("batch_shards", batch_shards)):
    if v < 1:
      raise ValueError(f"microbatch_plan: {name} must be >= 1, got {v}.")
  if tokens_per_device <= 0:
    rows = -(-batch_size // batch_shards) * batch_shards
    return rows, 1
  per_micro = batch_shards * max(1, tokens_per_device // row_len)
  micro = -(-batch_size // per_micro)
  return micro * per_micro, micro


def parse_mesh_shape(text: str) -> dict[str, int]:
  """"data=1,fsdp=-1" -> {"data": 1, "fsdp": -1} (the ``mesh.shape`` config string).

  Raises ValueError naming ``mesh.shape`` on a malformed entry."""
  out = {}
  for part in filter(None, (p.strip() for p in text.split(","))):
    name, eq, size = part.partition("=")
    try:
      out[name.strip()] = int(size)
    except ValueError:
      eq = ""
    if not eq or not name.strip():
      raise ValueError(f"mesh.shape={text!r}: entries look like 'fsdp=8' or 'data=-1', "
                       "separated by commas.")
  return out


def process_rows(batch_sharding: NamedSharding, rows: int) -> np.ndarray:
  """Global row indices this process must feed for a batch of ``rows`` rows laid out with
  ``batch_sharding`` (sorted; contiguous for the usual process-major meshes)."""
  idx = batch_sharding.addressable_devices_indices_map((rows,))
  out = set()
  for sl in idx.values():
    out.update(range(*sl[0].indices(rows)))
  return np.array(sorted(out), np.int64)
