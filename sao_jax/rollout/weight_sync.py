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

Buckets and layouts. A version moves in **buckets** (consecutive pieces up to
``bucket_bytes``; ``plan_buckets``), one transfer pull or one Ray object each, so no transport
message holds the whole tree and the receiver can place a bucket while the next one moves. A
piece is one distinct slice ``(leaf, box)`` that the receiver's devices hold (``layout``: its
parameter shardings, e.g. the engine's tensor-parallel layout, or replicated on its mesh): for
"transfer" the publisher arms exactly those slices (a sharded receiver pulls each slice once,
to the device that holds it, never a whole leaf to one device); for "object_store" the buckets
hold whole leaves, shared by every receiver, and each receiver copies only its slices to its
devices (on one node ``ray.get`` maps them without a copy). ``WeightPuller.pull`` assembles a
leaf once all of its slices landed and returns the tree only when every bucket has landed, so a
receiver never mixes two versions.

Errors: ``WeightMismatchError`` (ValueError) when the received tree's structure, shapes or
dtypes differ from the receiver's model -- a configuration error, never retried.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import threading
import time
from typing import Any, Optional

import jax
import numpy as np

TRANSPORTS = ("transfer", "object_store")
# pull ids: unique in this process across publishers, so no two armed pulls share one
_UUIDS = itertools.count((os.getpid() & 0xFFFF) << 40)


class WeightMismatchError(ValueError):
  """The published parameter tree does not match the receiving model (structure, shape or
  dtype): the actor was built from a different model config than the trainer."""


@dataclasses.dataclass(frozen=True)
class WeightRef:
  """What a receiver needs to fetch one published version (small; travels as a Ray argument).

  version: policy_version of these weights. transport: "transfer" | "object_store".
  treedef: the parameter tree's ``PyTreeDef``. avals: per leaf ``(shape, dtype name)``.
  address / uuid: the transfer server and the pull armed for this receiver ("transfer").
  buckets: per bucket, the pieces it holds: ``((leaf index, box), ...)`` with ``box`` one
  ``(start, stop)`` per dimension.
  uuids: per bucket, the transfer pull armed for this receiver ("transfer").
  object_ref: a one-element list holding the list of per-bucket Ray ``ObjectRef``s of the host
  leaves ("object_store"; inside a list so Ray does not resolve them on the way).
  nbytes: total parameter bytes (for GB/s metrics).
  """
  version: int
  transport: str
  treedef: Any
  avals: tuple
  nbytes: int
  buckets: tuple = ()
  address: str = ""
  uuids: tuple = ()
  object_ref: Optional[list] = None

  @property
  def piece_bytes(self) -> int:
    """Bytes of the pieces in this ref's buckets (what a "transfer" receiver moves)."""
    return sum(_box_bytes(box, self.avals[i][1]) for b in self.buckets for i, box in b)


def _avals(leaves) -> tuple:
  return tuple((tuple(int(d) for d in x.shape), str(np.dtype(x.dtype))) for x in leaves)


def avals_of(tree) -> tuple:
  """``WeightRef.avals`` of a pytree of arrays / ShapeDtypeStructs."""
  return _avals(jax.tree.leaves(tree))


def _box_bytes(box, dtype: str) -> int:
  return int(np.prod([b - a for a, b in box], dtype=np.int64)) * np.dtype(dtype).itemsize


def _full_box(shape) -> tuple:
  return tuple((0, int(d)) for d in shape)


def _slices(box) -> tuple:
  return tuple(slice(a, b) for a, b in box)


def device_boxes(sharding, shape) -> dict:
  """``{device: box}`` for this process's devices of ``sharding`` over an array of ``shape``
  (``box``: one ``(start, stop)`` per dimension: the slice that device holds)."""
  shape = tuple(int(d) for d in shape)
  return {d: tuple(sl.indices(n)[:2] for sl, n in zip(idx, shape))
          for d, idx in sharding.addressable_devices_indices_map(shape).items()}


def layout(shardings, avals) -> tuple:
  """The receiver's layout: per leaf, the distinct boxes its devices hold (sorted). A leaf
  replicated on every device has one box (the whole leaf); one split over ``tensor`` has one
  box per shard. ``shardings``: one ``jax.sharding.Sharding`` per leaf (treedef order);
  ``avals``: ``WeightRef.avals``."""
  return tuple(tuple(sorted(set(device_boxes(s, shape).values())))
               for s, (shape, _) in zip(shardings, avals))


def plan_buckets(avals, boxes=None, bucket_bytes: int = 0) -> tuple:
  """Groups the pieces ``(leaf, box)`` (``boxes``: a ``layout``; default whole leaves) into
  buckets of at most ``bucket_bytes`` each, in leaf order (a piece larger than that is a bucket
  of its own; ``bucket_bytes <= 0``: one bucket). Deterministic: publisher and receiver plan
  the same buckets from the same inputs."""
  if boxes is None:
    boxes = tuple((_full_box(s),) for s, _ in avals)
  out, cur, size = [], [], 0
  for i, leaf_boxes in enumerate(boxes):
    for box in leaf_boxes:
      n = _box_bytes(box, avals[i][1])
      if cur and bucket_bytes > 0 and size + n > bucket_bytes:
        out.append(tuple(cur))
        cur, size = [], 0
      cur.append((i, box))
      size += n
  if cur:
    out.append(tuple(cur))
  return tuple(out)


def _piece(leaf, box):
  """The trainer's slice ``box`` of ``leaf`` as a one-device array (what one transfer pull
  sends): the leaf itself when the box is whole and the leaf sits on one device."""
  whole = box == _full_box(leaf.shape)
  x = leaf if whole else leaf[_slices(box)]
  if len(x.sharding.device_set) > 1:  # a sharded/replicated trainer leaf: its slice, one device
    x = jax.device_put(x, jax.sharding.SingleDeviceSharding(sorted(
        x.sharding.device_set, key=lambda d: d.id)[0]))
  return x


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
  returns a ``WeightRef`` for one receiver (arming its transfer pulls, or the shared Ray
  objects). Neither waits for a receiver: a pull happens on the receiver's time.

  Versions: only the newest is held here. A receiver still pulling an older version finishes
  it: its armed pulls ("transfer") or the Ray objects its ref holds ("object_store") keep that
  version's buckets alive until it is done; then it is handed the newest.

  Memory ("transfer"): a receiver that holds whole leaves pulls the trainer's own arrays (no
  copy); one whose layout slices a leaf pulls slices cut once per version on the trainer's
  device (shared by every receiver of that layout), freed when the last armed pull is consumed.

  Args:
    transport: "transfer" or "object_store".
    ip: address the transfer server binds to (default: this node's IP).
    bucket_bytes: bytes per bucket (``plan_buckets``; 0 = the whole tree in one bucket).
  Raises ValueError for an unknown transport.
  """

  def __init__(self, transport: str = "transfer", ip: Optional[str] = None,
               bucket_bytes: int = 0):
    if transport not in TRANSPORTS:
      raise ValueError(f"rollout.weight_sync={transport!r}; use one of {TRANSPORTS} or 'auto'.")
    self.transport = transport
    self.bucket_bytes = int(bucket_bytes)
    self._lock = threading.Lock()
    self._server = start_transfer_server(ip) if transport == "transfer" else None
    self._drain_server = None
    self._params = self._leaves = self._treedef = self._avals = None
    self._object_refs = self._buckets = None
    self._pieces: dict = {}
    self.version = -1
    self.nbytes = 0

  @property
  def address(self) -> str:
    return self._server.address() if self._server is not None else ""

  def publish(self, params, version: int) -> None:
    """Makes ``params`` (a pytree of jax arrays; not copied, do not donate them afterwards)
    the newest version. "transfer": only registers them (pulls are armed per receiver by
    ``ref_for``); "object_store": copies each bucket to the host and ``ray.put``s it (the
    host copy of one bucket at a time). Raises ValueError if ``version`` does not increase."""
    leaves, treedef = jax.tree.flatten(params)
    with self._lock:
      if version <= self.version:
        raise ValueError(f"policy_version must increase: got {version} after {self.version}.")
      self._params, self._leaves, self._treedef = params, leaves, treedef
      self._avals = _avals(leaves)
      self.nbytes = int(sum(np.dtype(d).itemsize * int(np.prod(s)) for s, d in self._avals))
      self.version = int(version)
      self._object_refs = None
      self._pieces = {}
      self._buckets = plan_buckets(self._avals, None, self.bucket_bytes)
      if self.transport == "object_store":
        import ray  # pylint: disable=import-outside-toplevel  (ray is optional: only the ray backend)
        self._object_refs = [ray.put([_to_host(leaves[i]) for i, _ in bucket])
                             for bucket in self._buckets]

  def ref_for(self, receiver_layout=None) -> WeightRef:
    """A ``WeightRef`` to the newest version for ONE receiver ("transfer": arms one pull per
    bucket of the pieces of ``receiver_layout`` (a ``layout``; default whole leaves), each of
    which this receiver must make, or ``drain`` must consume). Raises RuntimeError before the
    first ``publish``, ValueError for a layout of another tree."""
    with self._lock:
      if self.version < 0:
        raise RuntimeError("WeightPublisher.ref_for before any publish.")
      if self.transport == "transfer":
        if receiver_layout is not None and len(receiver_layout) != len(self._avals):
          raise ValueError(f"receiver layout has {len(receiver_layout)} leaves, the published "
                           f"tree {len(self._avals)}: build the actor from the trainer's model.")
        buckets = plan_buckets(self._avals, receiver_layout, self.bucket_bytes)
        uuids = []
        for bucket in buckets:
          uuids.append(next(_UUIDS))
          self._server.await_pull(uuids[-1], [self._piece(i, box) for i, box in bucket])
        return WeightRef(self.version, "transfer", self._treedef, self._avals, self.nbytes,
                         buckets=buckets, address=self.address, uuids=tuple(uuids))
      return WeightRef(self.version, "object_store", self._treedef, self._avals, self.nbytes,
                       buckets=self._buckets, object_ref=[self._object_refs])

  def _piece(self, i: int, box) -> Any:
    """The newest version's piece ``(i, box)``, sliced once per version (receivers with the same
    layout share it; a whole leaf is the trainer's own array, no copy)."""
    key = (i, box)
    if key not in self._pieces:
      self._pieces[key] = _piece(self._leaves[i], box)
    return self._pieces[key]

  def drain(self, ref: WeightRef, first_bucket: int = 0) -> None:
    """Consumes the armed pulls of buckets ``first_bucket..`` whose receiver died before making
    them (frees that version's pieces). Each bucket is drained on its own daemon thread (a
    bucket the receiver did pull after all would block its thread until the server closes).
    No-op for "object_store" refs."""
    if ref.transport != "transfer":
      return
    with self._lock:
      if self._drain_server is None:
        self._drain_server = start_transfer_server(ref.address.rsplit(":", 1)[0])
      server = self._drain_server
    for b in range(first_bucket, len(ref.buckets)):
      threading.Thread(target=WeightPuller(server=server).fetch_bucket, args=(ref, b),
                       daemon=True).start()

  def close(self) -> None:
    self._params = self._leaves = self._object_refs = None
    self._pieces = {}


def _gate() -> None:
  """Test hook: while the file named by ``SAO_TEST_PULL_GATE`` exists, wait (before each bucket
  after a pull's first: a pull held half-way)."""
  path = os.environ.get("SAO_TEST_PULL_GATE", "")
  while path and os.path.exists(path):
    time.sleep(0.05)


class WeightPuller:
  """Receiver side: fetches a ``WeightRef`` into this process's devices, bucket by bucket.

  Args:
    sharding: where the pulled leaves live: one ``jax.sharding.Sharding`` for every leaf, or a
      sequence of one per leaf (treedef order), e.g. the engine's parameter shardings (default:
      the first local device).
    server: an existing transfer server to pull through (default: started on first pull).
  Attributes: ``version`` (last version pulled), ``pulling`` (version in progress, -1 none),
  ``buckets_done`` (buckets of it landed).
  """

  def __init__(self, sharding=None, server=None):
    self.sharding = sharding or jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    self._server = server
    self._conns: dict[str, Any] = {}
    self.version = -1
    self.pulling = -1
    self.buckets_done = 0

  def shardings(self, n: int) -> list:
    """One sharding per leaf for a tree of ``n`` leaves."""
    if isinstance(self.sharding, jax.sharding.Sharding):
      return [self.sharding] * n
    if len(self.sharding) != n:
      raise ValueError(f"{len(self.sharding)} shardings for {n} leaves.")
    return list(self.sharding)

  def layout(self, avals) -> tuple:
    """This receiver's ``layout`` for a tree with ``avals`` (give it to ``ref_for``)."""
    return layout(self.shardings(len(avals)), avals)

  def fetch_bucket(self, ref: WeightRef, b: int, devices=None) -> list:
    """Bucket ``b`` of ``ref``: "transfer": its pieces as one-device arrays (each on
    ``devices[k]``, default the first local device); "object_store": the host arrays of its
    (whole) leaves."""
    if ref.transport == "transfer":
      if self._server is None:
        self._server = start_transfer_server(ref.address.rsplit(":", 1)[0]
                                             if ref.address.startswith("127.") else None)
      conn = self._conns.get(ref.address)
      if conn is None:
        conn = self._conns[ref.address] = self._server.connect(ref.address)
      dev0 = jax.local_devices()[0]
      specs = [jax.ShapeDtypeStruct(tuple(e - s for s, e in box), np.dtype(ref.avals[i][1]),
                                    sharding=jax.sharding.SingleDeviceSharding(
                                        devices[k] if devices else dev0))
               for k, (i, box) in enumerate(ref.buckets[b])]
      return list(conn.pull(ref.uuids[b], specs))
    if ref.transport == "object_store":
      import ray  # pylint: disable=import-outside-toplevel  (ray is optional: only the ray backend)
      return [_from_host(a, ref.avals[i][1])
              for a, (i, _) in zip(ray.get(ref.object_ref[0][b]), ref.buckets[b])]
    raise ValueError(f"unknown weight transport {ref.transport!r}; use one of {TRANSPORTS}.")

  def pull_leaves(self, ref: WeightRef) -> list:
    """The leaves of ``ref`` as jax arrays on this receiver's shardings (list, treedef order).
    Bucket by bucket: each piece goes to the devices that hold its box (on CPU the
    object-store pieces alias the read-only shared-memory buffers; jax holds the numpy views,
    which pin the Ray object, and params are never donated on the rollout side); a leaf is
    assembled once all its boxes landed."""
    shardings = self.shardings(len(ref.avals))
    need = [device_boxes(s, shape) for s, (shape, _) in zip(shardings, ref.avals)]
    shards: list[dict] = [{} for _ in ref.avals]
    leaves: list = [None] * len(ref.avals)
    self.buckets_done = 0
    for b, bucket in enumerate(ref.buckets):
      if b:
        _gate()
      firsts = [min((d for d, bx in need[i].items() if bx == box), key=lambda d: d.id)
                if ref.transport == "transfer" else None for i, box in bucket]
      # wait for the bucket's bytes: a pull returns futures, and a version must have landed
      # before the worker gets it (else its next engine call would wait for the network)
      got = jax.block_until_ready(self.fetch_bucket(ref, b, firsts))
      for (i, box), x, dev in zip(bucket, got, firsts):
        for d, want in need[i].items():
          if ref.transport == "transfer":  # a piece is exactly one box this receiver holds
            if want == box:
              shards[i][d] = x if d == dev else jax.device_put(x, d)
          else:  # a whole host leaf: copy out each device's box
            shards[i][d] = jax.device_put(x[_slices(want)], d)
        if len(shards[i]) == len(need[i]):
          shape = ref.avals[i][0]
          sh = shardings[i]
          one = next(iter(shards[i].values())) if len(shards[i]) == 1 else None
          leaves[i] = (one if one is not None and one.sharding == sh else
                       jax.make_array_from_single_device_arrays(
                           shape, sh, [shards[i][d] for d in need[i]]))
          shards[i] = {}
      self.buckets_done = b + 1
    jax.block_until_ready(leaves)
    missing = [i for i, x in enumerate(leaves) if x is None]
    if missing:
      raise ValueError(f"weight ref version {ref.version}: leaves {missing[:5]} not covered by "
                       "its buckets (a ref armed for another receiver layout).")
    return leaves

  def pull(self, ref: WeightRef, expected=None):
    """Fetches ``ref`` and returns the params pytree, or None if ``ref.version`` is not newer
    than the last one pulled (newest wins). Returns only when every bucket has landed.

    expected: a pytree of arrays / ShapeDtypeStructs of the receiving model; when given, the
    ref's structure, shapes and dtypes must equal it (else ``WeightMismatchError``, raised
    before any bytes move)."""
    if ref.version <= self.version:
      return None
    if expected is not None:
      check_matches(ref, expected)
    self.pulling = ref.version
    try:
      leaves = self.pull_leaves(ref)
    finally:
      self.pulling = -1
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
