"""Trainer side of disaggregated rollout: connect to one or more inference hosts.

``HostPool(["hostA:9001", "hostB:9001"], traj_queue)`` runs one pump thread per host that pulls
finished trajectories (``Take``, at most as many as the trainer's bounded ``TrajectoryQueue`` has
room for) and puts them on that queue. A full trainer queue stops the pulls; the host's own
bounded queue then fills and blocks its rollout worker: backpressure end to end, and no
trajectory waits in a network buffer where staleness control cannot see it. ``publish``
sends ``(params, version)`` to every live host; ``CheckpointPublisher`` writes them to a shared
path instead. A lost host is waited for and reconnected (``HostPool`` docstring) while the others
keep feeding the trainer. ``decode`` is plain generation through JetStream's own client API.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any, Optional, Sequence

import grpc

from sao_jax.rollout import jetstream_compat, wire
from sao_jax.rollout.sync import TrajectoryQueue

logger = logging.getLogger(__name__)

# A host that answers with one of these has a problem waiting will not fix (a host started with
# another model config refuses the weights: UNKNOWN "Exception calling application: ..."; another
# server on that port: UNIMPLEMENTED): the pool fails loudly. Every other code (UNAVAILABLE,
# DEADLINE_EXCEEDED, CANCELLED, INTERNAL, RESOURCE_EXHAUSTED, ABORTED) means the host or the
# network went away: the host is marked down and retried.
_FATAL_CODES = frozenset({
    grpc.StatusCode.UNKNOWN, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.DATA_LOSS, grpc.StatusCode.ALREADY_EXISTS})


def _stub(channel, method: str, stream: bool = False):
  ident = lambda b: b  # noqa: E731
  make = channel.unary_stream if stream else channel.unary_unary
  return make(f"/{wire.SERVICE}/{method}", request_serializer=ident, response_deserializer=ident)


def _describe(e: BaseException) -> str:
  if isinstance(e, grpc.RpcError) and hasattr(e, "code"):
    return f"{e.code().name}: {e.details()}"
  return f"{type(e).__name__}: {e}"


def is_transient(e: BaseException) -> bool:
  """True for gRPC errors that a lost / restarting host or network produces (retry them)."""
  return isinstance(e, grpc.RpcError) and hasattr(e, "code") and e.code() not in _FATAL_CODES


class HostsUnreachableError(RuntimeError):
  """Every rollout host has been unreachable for longer than ``reconnect_timeout_s``."""


@dataclasses.dataclass
class _Host:
  address: str
  channel: Any
  up: bool = True  # the last call to it succeeded (or none was made yet)
  down_since: Optional[float] = None  # time.monotonic() when it was marked down
  downs: int = 0  # times it was lost
  reconnects: int = 0  # times it answered again after being lost
  restarts: int = 0  # times it answered with a new instance id (weights lost)
  resyncs: int = 0  # latest weights re-sent by its pump (after a reconnect or restart)
  version: int = -2  # its weights version as last reported (-2: not known yet)
  instance: Optional[str] = None  # its process's random id (host.py), None until known
  last_error: str = ""
  send_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)


class HostPool:
  """Streams trajectories from ``addresses`` (``"host:rl_port"``) into ``traj_queue``.

  A lost host does not stop training. When a call to a host fails with a transient gRPC error
  (``is_transient``: UNAVAILABLE, DEADLINE_EXCEEDED, ...), its pump marks it down and probes it
  (``Status``) with capped exponential backoff: ``backoff_s``, doubling up to ``max_backoff_s``
  seconds (the gRPC channel's own reconnect backoff is capped the same way). The other hosts keep
  feeding the queue meanwhile. When the host answers again it is marked up; if it lost its
  weights (a restarted process: new ``instance`` id, version -1) or is behind, the pool first
  re-sends the latest published ``(params, version)`` and only then pulls from it, so it never
  samples with its random init or a stale policy. A restart noticed through a ``Take`` reply
  alone (no failed call: e.g. killed and restarted while the trainer's queue was full) is
  handled the same way before the next pull.

  What is lost: trajectories in a lost host's memory (its queue and running slots) die with it.
  The trainer never counted them -- it counts only what it consumed from ``traj_queue``
  (``take_batch``, the prompt ledger), so nothing has to be undone; trajectories already pulled
  into ``traj_queue`` stay there. The trainer's params, optimizer state, version and counters
  are untouched: it just waits in ``take_batch`` while no host delivers.

  Errors: ``check()`` raises ``HostsUnreachableError`` only once *every* host has been down for
  longer than ``reconnect_timeout_s`` seconds (message: each host, how long it has been down,
  its last error, and the fix); ``RuntimeError`` at once for a permanent error (a host refusing
  the weights, another service on the port: see ``_FATAL_CODES``). ``publish`` raises only for
  such a permanent error, never because a host is down.

  Args:
    addresses: ``"host:rl_port"`` of each ``python -m sao_jax.rollout.host``.
    traj_queue: the trainer's bounded queue.
    reconnect_timeout_s: seconds all hosts may be down at once before ``check()`` raises.
    backoff_s / max_backoff_s: first and largest wait (seconds) between probes of a down host.
    take_timeout_s: deadline of one ``Take`` call (the host waits at most 1 s for a first item).
    publish_timeout_s: deadline of one ``PublishWeights`` call (large models: raise it).
    probe_timeout_s: deadline of one ``Status`` probe of a down host.

  Attributes: ``received`` (trajectories per address), ``error`` (first permanent failure, or
  None); ``counters()`` / ``metrics()`` for logging.
  """

  def __init__(self, addresses: Sequence[str], traj_queue: TrajectoryQueue, *,
               reconnect_timeout_s: float = 300.0, backoff_s: float = 0.5,
               max_backoff_s: float = 10.0, take_timeout_s: float = 60.0,
               publish_timeout_s: float = 300.0, probe_timeout_s: float = 10.0):
    if not addresses:
      raise ValueError("rollout.hosts is empty: give at least one 'host:rl_port'.")
    if len(set(addresses)) != len(addresses):
      raise ValueError(f"rollout.hosts lists an address twice: {list(addresses)}.")
    if not reconnect_timeout_s > 0 or not backoff_s > 0 or not max_backoff_s >= backoff_s:
      raise ValueError(f"HostPool needs reconnect_timeout_s > 0 and 0 < backoff_s <= "
                       f"max_backoff_s; got {reconnect_timeout_s}, {backoff_s}, {max_backoff_s}.")
    self.addresses = list(addresses)
    self.queue = traj_queue
    self.reconnect_timeout_s, self.backoff_s, self.max_backoff_s = (
        float(reconnect_timeout_s), float(backoff_s), float(max_backoff_s))
    self.take_timeout_s, self.publish_timeout_s, self.probe_timeout_s = (
        float(take_timeout_s), float(publish_timeout_s), float(probe_timeout_s))
    options = wire.GRPC_OPTIONS + [
        ("grpc.initial_reconnect_backoff_ms", int(self.backoff_s * 1000)),
        ("grpc.max_reconnect_backoff_ms", int(self.max_backoff_s * 1000))]
    self._hosts = {a: _Host(a, grpc.insecure_channel(a, options=options)) for a in addresses}
    self.channels = {a: h.channel for a, h in self._hosts.items()}
    self.received = {a: 0 for a in addresses}
    self.error: Optional[BaseException] = None
    self.stop_event = threading.Event()
    self._lock = threading.Lock()
    self._latest: Optional[tuple[bytes, int]] = None  # (serialized weights, version)
    self._threads: list[threading.Thread] = []

  def wait_ready(self, timeout: float = 120.0) -> list[dict]:
    """Blocks until every host answers ``Status``; returns their status dicts.
    Raises TimeoutError naming the hosts that did not answer."""
    out = []
    for a, h in self._hosts.items():
      try:
        grpc.channel_ready_future(h.channel).result(timeout=timeout)
      except grpc.FutureTimeoutError as e:
        raise TimeoutError(f"rollout host {a} did not answer within {timeout}s; is "
                           f"`python -m sao_jax.rollout.host` running there?") from e
      st = wire.unpack(_stub(h.channel, "Status")(b"", timeout=timeout))
      self._note_reply(h, st)
      out.append(st)
    return out

  def status(self, timeout: float = 30.0) -> list[dict]:
    """One dict per address (in order): the host's ``Status`` plus ``"address"``; for a host that
    does not answer within ``timeout`` seconds, ``{"address", "error"}`` instead (no raise)."""
    out = []
    for a, h in self._hosts.items():
      try:
        st = wire.unpack(_stub(h.channel, "Status")(b"", timeout=timeout))
        self._note_reply(h, st)
        out.append({**st, "address": a})
      except grpc.RpcError as e:
        out.append({"address": a, "error": _describe(e)})
    return out

  # ---- weights -----------------------------------------------------------------------------------
  def publish(self, params: Any, version: int) -> list[str]:
    """Sends ``(params, version)`` (serialized once) to every host that is up; remembers them as
    the latest, which a host that is down gets when it answers again. A host failing now is
    marked down (no raise). Returns the addresses that hold ``version`` (or newer) afterwards.
    Raises RuntimeError if a host refuses the weights (e.g. another model config)."""
    body, version = wire.params_to_bytes(params, version), int(version)
    with self._lock:
      if self._latest is None or version > self._latest[1]:
        self._latest = (body, version)
    reached = []
    for h in self._hosts.values():
      if not h.up:
        continue
      try:
        self._send(h, body, version)
        reached.append(h.address)
      except grpc.RpcError as e:
        if is_transient(e):
          self._mark_down(h, e)
        else:
          raise self._fail(h, "refused the weights", e) from e
    return reached

  @property
  def latest_version(self) -> Optional[int]:
    """Version of the newest weights given to ``publish`` (None before the first)."""
    with self._lock:
      return None if self._latest is None else self._latest[1]

  def _send(self, h: _Host, body: bytes, version: int) -> bool:
    """``PublishWeights`` to ``h`` unless it already holds ``version``; True if sent."""
    with h.send_lock:  # one send per host at a time (the trainer's publish, its pump's re-send)
      if h.version >= version:
        return False
      ack = wire.unpack(_stub(h.channel, "PublishWeights")(body, timeout=self.publish_timeout_s))
      self._note_reply(h, ack)
      return True

  def _sync(self, h: _Host) -> None:
    """Re-sends the latest weights to ``h`` if it is behind them (lost on restart, or published
    while it was down). Raises grpc.RpcError like any call."""
    with self._lock:
      latest = self._latest
    had = h.version
    if latest is not None and had < latest[1] and self._send(h, *latest):
      with self._lock:
        h.resyncs += 1
      logger.warning("rollout host %s: re-sent policy version %d (it had %d)", h.address,
                     latest[1], had)

  # ---- host state --------------------------------------------------------------------------------
  def _note_reply(self, h: _Host, msg: dict) -> None:
    """Learns the host's weights version and instance id from a reply (hosts before the
    ``instance`` field: version only)."""
    inst, version = msg.get("instance"), msg.get("version")
    with self._lock:
      if inst is not None and inst != h.instance:
        if h.instance is not None:
          h.restarts += 1
          logger.warning("rollout host %s restarted (version %s): its weights and queued "
                         "trajectories are lost; the latest weights are re-sent", h.address,
                         version)
        h.instance = inst
        if version is not None:
          h.version = int(version)  # a new process: its own report is the truth
      elif version is not None:
        h.version = max(h.version, int(version))  # replies can arrive out of order

  def _mark_down(self, h: _Host, e: BaseException) -> None:
    with self._lock:
      h.last_error = _describe(e)
      if h.up:
        h.up, h.down_since, h.downs = False, time.monotonic(), h.downs + 1
        logger.warning("rollout host %s lost (%s); retrying every <= %.0fs, the other hosts "
                       "keep feeding the trainer", h.address, h.last_error, self.max_backoff_s)

  def _mark_up(self, h: _Host) -> None:
    with self._lock:
      if not h.up:
        down_s = time.monotonic() - h.down_since
        h.up, h.down_since, h.reconnects = True, None, h.reconnects + 1
        logger.warning("rollout host %s reconnected after %.1fs (version %d)", h.address, down_s,
                       h.version)

  def _fail(self, h: _Host, what: str, e: BaseException) -> RuntimeError:
    err = RuntimeError(f"rollout host {h.address} {what}: {_describe(e)}")
    with self._lock:
      self.error = self.error or err
    return err

  # ---- pulling -----------------------------------------------------------------------------------
  def _pump(self, h: _Host) -> None:
    take, probe = _stub(h.channel, "Take"), _stub(h.channel, "Status")
    delay = self.backoff_s
    while not self.stop_event.is_set():
      try:
        if not h.up:
          self._note_reply(h, wire.unpack(probe(b"", timeout=self.probe_timeout_s)))
          self._sync(h)  # weights first: it must not sample with a lost / stale policy
          self._mark_up(h)
          delay = self.backoff_s
        self._sync(h)  # no call unless it is behind the latest publish (e.g. restarted)
        room = self.queue.maxsize - self.queue.qsize()
        if room <= 0:
          time.sleep(self.queue.poll_s)
          continue
        msg = wire.unpack(take(wire.pack({"max_items": room, "timeout_s": 1.0}),
                               timeout=self.take_timeout_s))
        self._note_reply(h, msg)  # a new instance id here: re-sent before the next pull
        for i in range(len(msg["items"])):
          traj = wire.trajectory_from_dict(msg["items"][str(i)])
          if not self.queue.put(traj, self.stop_event):
            return
          with self._lock:
            self.received[h.address] += 1
      except grpc.RpcError as e:
        if self.stop_event.is_set():
          return
        if not is_transient(e):
          self._fail(h, "failed", e)
          return
        self._mark_down(h, e)
        self.stop_event.wait(delay)
        delay = min(2 * delay, self.max_backoff_s)
      except Exception as e:  # pylint: disable=broad-except  (a bad reply: report, not vanish)
        self._fail(h, "sent a reply this trainer cannot read", e)
        return

  def start(self) -> "HostPool":
    for h in self._hosts.values():
      t = threading.Thread(target=self._pump, args=(h,), daemon=True, name=f"pump-{h.address}")
      t.start()
      self._threads.append(t)
    return self

  # ---- health and counters -----------------------------------------------------------------------
  def _unreachable_message(self) -> Optional[str]:
    """The error text once every host has been down > ``reconnect_timeout_s``, else None."""
    now = time.monotonic()
    with self._lock:
      hosts = list(self._hosts.values())
      if any(h.up for h in hosts):
        return None
      if min(now - h.down_since for h in hosts) <= self.reconnect_timeout_s:
        return None
      lines = "; ".join(f"{h.address} (down {now - h.down_since:.1f}s, {h.downs} time(s) lost, "
                        f"last error {h.last_error})" for h in hosts)
      latest = "none yet" if self._latest is None else self._latest[1]
    return (f"all {len(hosts)} rollout host(s) have been unreachable for longer than "
            f"reconnect_timeout_s={self.reconnect_timeout_s:g}s: {lines}. The trainer's state is "
            f"intact (latest published policy version: {latest}; only consumed trajectories "
            f"were counted). Fix: (re)start `python -m sao_jax.rollout.host` at those "
            f"addresses (a reconnecting host gets the latest weights before it is pulled "
            f"from), check the addresses and the network, or raise reconnect_timeout_s.")

  def check(self) -> None:
    """Raises RuntimeError after a permanent host error, ``HostsUnreachableError`` once every
    host has been down for longer than ``reconnect_timeout_s``; otherwise returns."""
    if self.error is not None:
      raise RuntimeError(str(self.error)) from self.error
    msg = self._unreachable_message()
    if msg is not None:
      raise HostsUnreachableError(msg)

  def is_alive(self) -> bool:
    """False after a permanent error or once every host has been down > reconnect_timeout_s."""
    return (self.error is None and self._unreachable_message() is None
            and any(t.is_alive() for t in self._threads))

  def counters(self) -> dict[str, dict]:
    """Per address: ``up`` (bool), ``down_s`` (seconds down now, 0.0 when up), ``downs``
    (times lost), ``reconnects``, ``restarts`` (came back as a new process), ``resyncs`` (weights
    re-sent by the pool), ``received`` (trajectories pulled), ``version`` (its weights version as
    last reported; -2 unknown), ``last_error``."""
    now = time.monotonic()
    with self._lock:
      return {a: {"up": h.up, "down_s": 0.0 if h.up else now - h.down_since, "downs": h.downs,
                  "reconnects": h.reconnects, "restarts": h.restarts, "resyncs": h.resyncs,
                  "received": self.received[a], "version": h.version,
                  "last_error": h.last_error} for a, h in self._hosts.items()}

  def metrics(self) -> dict[str, float]:
    """Flat totals for a metrics line: ``hosts_up``, ``hosts_down``, ``host_downs``,
    ``host_reconnects``, ``host_restarts``, ``host_resyncs``, ``received``."""
    c = self.counters().values()
    return {"hosts_up": sum(x["up"] for x in c), "hosts_down": sum(not x["up"] for x in c),
            "host_downs": sum(x["downs"] for x in c),
            "host_reconnects": sum(x["reconnects"] for x in c),
            "host_restarts": sum(x["restarts"] for x in c),
            "host_resyncs": sum(x["resyncs"] for x in c),
            "received": sum(x["received"] for x in c)}

  def stop(self) -> None:
    self.stop_event.set()
    for t in self._threads:
      t.join(timeout=10)
    for ch in self.channels.values():
      ch.close()


class CheckpointPublisher:
  """Publishes weights through a shared path (``wire.write_weights``) that hosts started with
  ``--weights_dir`` poll."""

  def __init__(self, directory: str):
    self.directory = directory

  def publish(self, params: Any, version: int) -> None:
    wire.write_weights(self.directory, params, version)


def decode(address: str, *, text: Optional[str] = None, token_ids: Optional[Sequence[int]] = None,
           max_tokens: int = 16, timeout: float = 120.0) -> tuple[str, list[int]]:
  """Plain generation through JetStream's client API (``OrchestratorStub.Decode``) on a host's
  ``--port``. Give ``text`` (server-side tokenization) or ``token_ids`` (client side; JetStream
  prepends bos). ``max_tokens`` is JetStream's cap on prompt + generated length.
  Returns (text, generated token ids)."""
  pb, pb_grpc = jetstream_compat.decode_pb()
  if (text is None) == (token_ids is None):
    raise ValueError("decode needs exactly one of text= or token_ids=.")
  if text is not None:
    req = pb.DecodeRequest(text_content=pb.DecodeRequest.TextContent(text=text),
                           max_tokens=max_tokens)
  else:
    req = pb.DecodeRequest(token_content=pb.DecodeRequest.TokenContent(token_ids=list(token_ids)),
                           max_tokens=max_tokens)
  with grpc.insecure_channel(address) as ch:
    grpc.channel_ready_future(ch).result(timeout=timeout)
    out_text, ids = [], []
    for resp in pb_grpc.OrchestratorStub(ch).Decode(req, timeout=timeout):
      for s in resp.stream_content.samples:
        out_text.append(s.text)
        ids.extend(s.token_ids)
  return "".join(out_text), ids


def wait_for_port(address: str, timeout: float = 120.0) -> None:
  """Blocks until a gRPC server answers at ``address``; TimeoutError otherwise."""
  t0 = time.time()
  with grpc.insecure_channel(address) as ch:
    try:
      grpc.channel_ready_future(ch).result(timeout=timeout)
    except grpc.FutureTimeoutError as e:
      raise TimeoutError(f"nothing answered at {address} after {time.time() - t0:.0f}s.") from e
