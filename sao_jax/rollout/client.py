"""Trainer side of disaggregated rollout: connect to one or more inference hosts.

``HostPool(["hostA:9001", "hostB:9001"], traj_queue)`` runs one pump thread per host that pulls
finished trajectories (``Take``, at most as many as the trainer's bounded ``TrajectoryQueue`` has
room for) and puts them on that queue. A full trainer queue stops the pulls; the host's own
bounded queue then fills and blocks its rollout worker: backpressure end to end, and no
trajectory waits in a network buffer where staleness control cannot see it. ``publish``
sends ``(params, version)`` to every host; ``CheckpointPublisher`` writes them to a shared path
instead. ``decode`` is plain generation through JetStream's own client API.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Optional, Sequence

import grpc

from sao_jax.rollout import jetstream_compat, wire
from sao_jax.rollout.sync import TrajectoryQueue


def _stub(channel, method: str, stream: bool = False):
  ident = lambda b: b  # noqa: E731
  make = channel.unary_stream if stream else channel.unary_unary
  return make(f"/{wire.SERVICE}/{method}", request_serializer=ident, response_deserializer=ident)


class HostPool:
  """Streams trajectories from ``addresses`` (``"host:rl_port"``) into ``traj_queue``.

  Attributes: ``received`` (trajectories per address), ``error`` (first stream failure, or None).
  Raises RuntimeError from ``check()`` once a stream failed.
  """

  def __init__(self, addresses: Sequence[str], traj_queue: TrajectoryQueue):
    if not addresses:
      raise ValueError("rollout.hosts is empty: give at least one 'host:rl_port'.")
    self.addresses = list(addresses)
    self.queue = traj_queue
    self.channels = {a: grpc.insecure_channel(a, options=wire.GRPC_OPTIONS) for a in addresses}
    self.received = {a: 0 for a in addresses}
    self.error: Optional[BaseException] = None
    self.stop_event = threading.Event()
    self._threads: list[threading.Thread] = []

  def wait_ready(self, timeout: float = 120.0) -> list[dict]:
    """Blocks until every host answers ``Status``; returns their status dicts.
    Raises TimeoutError naming the hosts that did not answer."""
    out = []
    for a, ch in self.channels.items():
      try:
        grpc.channel_ready_future(ch).result(timeout=timeout)
      except grpc.FutureTimeoutError as e:
        raise TimeoutError(f"rollout host {a} did not answer within {timeout}s; is "
                           f"`python -m sao_jax.rollout.host` running there?") from e
      out.append(wire.unpack(_stub(ch, "Status")(b"", timeout=timeout)))
    return out

  def status(self) -> list[dict]:
    return [wire.unpack(_stub(ch, "Status")(b"", timeout=30)) for ch in self.channels.values()]

  def publish(self, params: Any, version: int) -> None:
    """Sends ``(params, version)`` to every host (serialized once)."""
    body = wire.params_to_bytes(params, version)
    for ch in self.channels.values():
      _stub(ch, "PublishWeights")(body, timeout=300)

  def _pump(self, address: str) -> None:
    take = _stub(self.channels[address], "Take")
    try:
      while not self.stop_event.is_set():
        room = self.queue.maxsize - self.queue.qsize()
        if room <= 0:
          time.sleep(self.queue.poll_s)
          continue
        msg = wire.unpack(take(wire.pack({"max_items": room, "timeout_s": 1.0}), timeout=60))
        for i in range(len(msg["items"])):
          traj = wire.trajectory_from_dict(msg["items"][str(i)])
          if not self.queue.put(traj, self.stop_event):
            return
          self.received[address] += 1
    except grpc.RpcError as e:
      if not self.stop_event.is_set():
        self.error = self.error or RuntimeError(f"trajectory pull from {address} failed: {e}")

  def start(self) -> "HostPool":
    for a in self.addresses:
      t = threading.Thread(target=self._pump, args=(a,), daemon=True, name=f"pump-{a}")
      t.start()
      self._threads.append(t)
    return self

  def check(self) -> None:
    if self.error is not None:
      raise RuntimeError(str(self.error)) from self.error

  def is_alive(self) -> bool:
    return self.error is None and any(t.is_alive() for t in self._threads)

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
