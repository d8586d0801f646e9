"""Trainer -> rollout-actor weight sync without a size cap.

Two transports, one message (``WeightRef``):

* ``"transfer"``: ``jax.experimental.transfer``. The trainer's ``TransferServer`` arms one pull
  per (version, receiver) with ``await_pull(uuid, params)``; the receiver connects to the
  server's address and ``pull(uuid, avals)`` copies the arrays straight into its own device
  buffers. Nothing is gathered to the trainer's host and no message size limit applies. Facts
  checked on jax 0.10.2 (CPU): the server must be started on an explicit ``ip:0`` with a
  transport address per device (``[::]:0`` fails to connect); one ``await_pull`` serves exactly
  one ``pull``; a second pull of the same uuid, or a pull of an expired or unknown uuid, blocks
  until the server closes (the pull ``timeout`` is not honoured) and then breaks the
  connection. So the publisher arms exactly one uuid per receiver and version, and an armed
  uuid whose receiver died is drained by the publisher itself (``WeightPublisher.drain``), or
  it would keep that version's arrays alive.
* ``"object_store"``: ``ray.put`` of the host copy (leaves as numpy, bfloat16 viewed as uint16
  so Ray stores them out of band, zero-copy on the receiving node); one put per version, shared
  by every receiver. Needs a running Ray.

The newest version wins: ``WeightPublisher.publish`` replaces the previous version (the old
Ray object is freed when no receiver holds it); a receiver (``WeightPuller``) ignores a ref
older than what it already has. Which receivers get which version when is the caller's job
(``ray_source.RaySource``: one sync in flight per actor, always the newest).

Errors: ``WeightMismatchError`` (ValueError) when the received tree's structure, shapes or
dtypes differ from the receiver's model -- a configuration error, never retried.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import threading
from typing import Any, Optional

import jax
import numpy as np

TRANSPORTS = ("transfer", "object_store")


class WeightMismatchError(ValueError):
  """The published parameter tree does not match the receiving model (structure, shape or
  dtype): the actor was built from a different model config than the trainer."""


@dataclasses.dataclass(frozen=True)
class WeightRef:
  """What a receiver needs to fetch one published version (small; travels as a Ray argument).

  version: policy_version of these weights. transport: "transfer" | "object_store".
  treedef: the parameter tree's ``PyTreeDef``. avals: per leaf ``(shape, dtype name)``.
  address / uuid: the transfer server and the pull armed for this receiver ("transfer").
  object_ref: a one-element list holding the Ray ``ObjectRef`` of the host leaves
  ("object_store"; inside a list so Ray does not resolve it on the way).
  nbytes: total parameter bytes (for GB/s metrics).
  """
  version: int
  transport: str
  treedef: Any
  avals: tuple
  nbytes: int
  address: str = ""
  uuid: int = -1
  object_ref: Optional[list] = None


def _avals(leaves) -> tuple:
  return tuple((tuple(int(d) for d in x.shape), str(np.dtype(x.dtype))) for x in leaves)


def node_ip() -> str:
  """This node's IP as Ray sees it (when Ray is initialised: 127.0.0.1 for the local Ray of
  ``ray_local.init_ray``, the node's cluster address on a cluster), else 127.0.0.1: the
  address the transfer servers bind."""
  try:
    import ray  # pylint: disable=import-outside-toplevel  (ray is optional: only the ray backend)
    if ray.is_initialized():
      return ray.util.get_node_ip_address()
  except ImportError:
    pass
  return "127.0.0.1"


def start_transfer_server(ip: Optional[str] = None):
  """A ``jax.experimental.transfer`` server on ``ip`` (default: ``node_ip()``), one transport
  address per local device. Raises RuntimeError if this jax build has no transfer server."""
  try:
    from jax.experimental import transfer  # pylint: disable=import-outside-toplevel  (experimental module: only the transfer transport)
  except ImportError as e:
    raise RuntimeError("jax.experimental.transfer is unavailable in this jax build; set "
                       "rollout.weight_sync='object_store'.") from e
  ip = ip or node_ip()
  client = jax.local_devices()[0].client
  return transfer.start_transfer_server(client, f"{ip}:0",
                                        [f"{ip}:0"] * jax.local_device_count())


def _to_host(x) -> np.ndarray:
  a = np.asarray(jax.device_get(x))
  return a.view(np.uint16) if a.dtype.name == "bfloat16" else a


def _from_host(a: np.ndarray, dtype: str) -> np.ndarray:
  return a.view(np.dtype(dtype)) if dtype == "bfloat16" else a


class WeightPublisher:
  """Trainer side. ``publish(params, version)`` makes ``version`` the newest; ``ref_for()``
  returns a ``WeightRef`` for one receiver (arming one transfer pull, or the shared Ray object).

  Args:
    transport: "transfer" or "object_store".
    ip: address the transfer server binds to (default: this node's IP).
  Raises ValueError for an unknown transport.
  """

  def __init__(self, transport: str = "transfer", ip: Optional[str] = None):
    if transport not in TRANSPORTS:
      raise ValueError(f"rollout.weight_sync={transport!r}; use one of {TRANSPORTS} or 'auto'.")
    self.transport = transport
    self._lock = threading.Lock()
    self._uuids = itertools.count((os.getpid() & 0xFFFF) << 40)
    self._server = start_transfer_server(ip) if transport == "transfer" else None
    self._drain_server = None
    self._params = self._leaves = self._treedef = self._avals = None
    self._object_ref = None
    self.version = -1
    self.nbytes = 0

  @property
  def address(self) -> str:
    return self._server.address() if self._server is not None else ""

  def publish(self, params, version: int) -> None:
    """Makes ``params`` (a pytree of jax arrays; not copied, do not donate them afterwards)
    the newest version. Raises ValueError if ``version`` does not increase."""
    leaves, treedef = jax.tree.flatten(params)
    with self._lock:
      if version <= self.version:
        raise ValueError(f"policy_version must increase: got {version} after {self.version}.")
      self._params, self._leaves, self._treedef = params, leaves, treedef
      self._avals = _avals(leaves)
      self.nbytes = int(sum(np.dtype(d).itemsize * int(np.prod(s)) for s, d in self._avals))
      self.version = int(version)
      self._object_ref = None
      if self.transport == "object_store":
        import ray  # pylint: disable=import-outside-toplevel  (ray is optional: only the ray backend)
        self._object_ref = ray.put([_to_host(x) for x in leaves])

  def ref_for(self) -> WeightRef:
    """A ``WeightRef`` to the newest version for ONE receiver ("transfer": arms one pull that
    this receiver must make, or that ``drain`` must consume). Raises RuntimeError before the
    first ``publish``."""
    with self._lock:
      if self.version < 0:
        raise RuntimeError("WeightPublisher.ref_for before any publish.")
      if self.transport == "transfer":
        uuid = next(self._uuids)
        self._server.await_pull(uuid, self._leaves)
        return WeightRef(self.version, "transfer", self._treedef, self._avals, self.nbytes,
                         address=self.address, uuid=uuid)
      return WeightRef(self.version, "object_store", self._treedef, self._avals, self.nbytes,
                       object_ref=[self._object_ref])

  def drain(self, ref: WeightRef) -> None:
    """Consumes an armed pull whose receiver died before making it (frees that version's
    arrays). Blocks until the pull completes; call it on a daemon thread. No-op for
    "object_store" refs."""
    if ref.transport != "transfer":
      return
    with self._lock:
      if self._drain_server is None:
        self._drain_server = start_transfer_server(ref.address.rsplit(":", 1)[0])
      server = self._drain_server
    WeightPuller(server=server).pull_leaves(ref)

  def close(self) -> None:
    self._params = self._leaves = self._object_ref = None


class WeightPuller:
  """Receiver side: fetches a ``WeightRef`` into this process's devices.

  Args:
    sharding: where the pulled leaves live (default: the first local device).
    server: an existing transfer server to pull through (default: started on first pull).
  """

  def __init__(self, sharding=None, server=None):
    self.sharding = sharding or jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    self._server = server
    self._conns: dict[str, Any] = {}
    self.version = -1

  def pull_leaves(self, ref: WeightRef) -> list:
    """The leaves of ``ref`` as jax arrays on ``self.sharding`` (list, in treedef order)."""
    if ref.transport == "transfer":
      if self._server is None:
        self._server = start_transfer_server(ref.address.rsplit(":", 1)[0]
                                             if ref.address.startswith("127.") else None)
      conn = self._conns.get(ref.address)
      if conn is None:
        conn = self._conns[ref.address] = self._server.connect(ref.address)
      specs = [jax.ShapeDtypeStruct(s, np.dtype(d), sharding=self.sharding) for s, d in ref.avals]
      return list(conn.pull(ref.uuid, specs))
    if ref.transport == "object_store":
      import ray  # pylint: disable=import-outside-toplevel  (ray is optional: only the ray backend)
      host = ray.get(ref.object_ref[0])
      # On CPU the jax arrays alias the (read-only) shared-memory buffers, even with
      # may_alias=False (checked: same pointer); jax holds the numpy views, which pin the Ray
      # object, and params are never donated on the rollout side. Elsewhere: a host->device copy.
      return [jax.device_put(_from_host(a, d), self.sharding)
              for a, (_, d) in zip(host, ref.avals)]
    raise ValueError(f"unknown weight transport {ref.transport!r}; use one of {TRANSPORTS}.")

  def pull(self, ref: WeightRef, expected=None):
    """Fetches ``ref`` and returns the params pytree, or None if ``ref.version`` is not newer
    than the last one pulled (newest wins).

    expected: a pytree of arrays / ShapeDtypeStructs of the receiving model; when given, the
    ref's structure, shapes and dtypes must equal it (else ``WeightMismatchError``, raised
    before any bytes move)."""
    if ref.version <= self.version:
      return None
    if expected is not None:
      check_matches(ref, expected)
    leaves = self.pull_leaves(ref)
    self.version = ref.version
    return jax.tree.unflatten(ref.treedef, leaves)


def check_matches(ref: WeightRef, expected) -> None:
  """Raises ``WeightMismatchError`` naming the first difference between ``ref`` and the
  receiving model's parameter tree ``expected``."""
  leaves, treedef = jax.tree.flatten(expected)
  if treedef != ref.treedef:
    raise WeightMismatchError(
        f"published parameter tree {ref.treedef} differs from the rollout actor's model "
        f"{treedef}: build the actor from the trainer's model config (config.model).")
  for i, ((s, d), (es, ed)) in enumerate(zip(ref.avals, _avals(leaves))):
    if (s, d) != (es, ed):
      path = jax.tree_util.keystr(jax.tree_util.tree_flatten_with_path(expected)[0][i][0])
      raise WeightMismatchError(
          f"parameter {path}: published {d}{list(s)}, rollout actor expects {ed}{list(es)}: "
          "the actor and the trainer were built from different model configs (config.model).")


def resolve_transport(name: str) -> str:
  """``rollout.weight_sync``: "auto" -> "object_store" on the CPU backend (one node's shared
  memory, zero-copy into CPU jax arrays: benchmarks/RESULTS.md section 6 measured it far faster
  than the transfer server's socket there), else "transfer" where this jax has
  ``jax.experimental.transfer.start_transfer_server``, else "object_store". Other names are
  checked and returned (ValueError for an unknown one)."""
  if name == "auto":
    if jax.default_backend() == "cpu":
      return "object_store"
    try:
      from jax.experimental import transfer  # pylint: disable=import-outside-toplevel  (experimental module: only the transfer transport)
      return "transfer" if hasattr(transfer, "start_transfer_server") else "object_store"
    except ImportError:
      return "object_store"
  if name not in TRANSPORTS:
    raise ValueError(f"rollout.weight_sync={name!r}; use 'auto' or one of {TRANSPORTS}.")
  return name
