"""A lost inference host does not stop the trainer: ``HostPool`` keeps pulling from the others,
reconnects with backoff, re-sends the latest weights to a restarted host before pulling from it,
and raises only once every host has been gone for longer than ``reconnect_timeout_s``.

In-process fake hosts (no JAX, < 1 s each) pin the pool's logic; one test SIGKILLs a real host
subprocess next to a second one and restarts it on the same port."""

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from concurrent import futures

import grpc
import jax
import numpy as np
import portpicker
import pytest
from flax import nnx

from sao_jax import tasks
from sao_jax.models.transformer import Transformer
from sao_jax.rollout import client, wire
from sao_jax.rollout.staleness import StalenessStats, take_batch
from sao_jax.rollout.sync import TrajectoryQueue
from sao_jax.rollout.trajectory import Trajectory
from rollout_fixtures import host_config, host_overrides
from sao_jax.train.loop import model_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAST = dict(backoff_s=0.05, max_backoff_s=0.2)  # probe a lost host every <= 0.2 s


def _until(cond, timeout=20.0, what="condition"):
  deadline = time.time() + timeout
  while not cond():
    if time.time() > deadline:
      raise AssertionError(f"timed out after {timeout}s waiting for {what}")
    time.sleep(0.02)


class FakeHost:
  """The ``sao_jax.RolloutHost`` service of ``host.py`` without a model: starts at version -1
  with a fresh instance id, produces nothing before weights arrive, then one trajectory per
  ``Take`` item stamped with its current version."""

  def __init__(self, port, name, refuse_weights=False):
    self.port, self.name, self.refuse_weights = port, name, refuse_weights
    self.version, self.instance = -1, uuid.uuid4().hex
    self.got_versions, self.produced = [], 0
    ident = lambda b: b  # noqa: E731
    h = lambda f: grpc.unary_unary_rpc_method_handler(  # noqa: E731
        f, request_deserializer=ident, response_serializer=ident)
    self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(wire.SERVICE, {
        "Take": h(self._take), "PublishWeights": h(self._publish), "Status": h(self._status)}),))
    self.server.add_insecure_port(f"[::]:{port}")
    self.server.start()

  def lose_weights(self):  # what a restart looks like from the wire
    self.version, self.instance = -1, uuid.uuid4().hex

  def _take(self, request, context):
    del context
    items = {}
    if self.version >= 0:
      for i in range(min(int(wire.unpack(request)["max_items"]), 2)):
        items[str(i)] = wire.trajectory_to_dict(Trajectory(
            "p", np.arange(4, dtype=np.int32), np.array([0, 0, 1, 1], np.float32),
            np.array([0, 0, -1, -1], np.float32), np.array([-1, -1] + [self.version] * 2,
                                                           np.int32), 1.0), self.name)
        self.produced += 1
    time.sleep(0.01 if items else 0.05)
    return wire.pack({"items": items, "version": self.version, "instance": self.instance})

  def _publish(self, request, context):
    del context
    if self.refuse_weights:
      raise ValueError("weights leaf ['w']: got (3,) float32, this model has (4,) float32")
    v = int(wire.unpack(request)["version"])
    self.got_versions.append(v)
    self.version = max(self.version, v)
    return wire.pack({"version": self.version, "instance": self.instance})

  def _status(self, request, context):
    del request, context
    return wire.pack({"version": self.version, "instance": self.instance,
                      "trajectories": self.produced, "name": self.name})

  def stop(self):
    self.server.stop(0).wait()


def _drain(queue, n, pool):
  trajs, _, _ = take_batch(queue, n, 0, on_empty=pool.check, poll_s=0.05)
  return trajs


def _drain_until(queue, pool, cond, what, rounds=200):
  """Consumes (making room for the pumps) until ``cond()``; returns what was consumed."""
  out = []
  for _ in range(rounds):
    if cond():
      return out
    out += _drain(queue, 1, pool)
  raise AssertionError(f"{what}: not after consuming {rounds} trajectories")


def test_all_hosts_down_error_names_hosts_time_and_fix():
  addrs = [f"localhost:{portpicker.pick_unused_port()}" for _ in range(2)]
  pool = client.HostPool(addrs, TrajectoryQueue(2), reconnect_timeout_s=0.5, **FAST)
  try:
    assert pool.publish({"w": np.zeros(3, np.float32)}, 0) == []  # no raise: they are just down
    pool.start()
    assert pool.is_alive()
    _until(lambda: not pool.is_alive(), 20, "the all-down timeout")
    with pytest.raises(client.HostsUnreachableError) as e:
      pool.check()
    msg = str(e.value)
    print(msg)
    for a in addrs:
      assert a in msg
    assert "all 2 rollout host(s) have been unreachable" in msg
    assert "reconnect_timeout_s=0.5s" in msg and "UNAVAILABLE" in msg
    assert "latest published policy version: 0" in msg
    assert "python -m sao_jax.rollout.host" in msg and "raise reconnect_timeout_s" in msg
    c = pool.counters()
    assert all(not x["up"] and x["down_s"] > 0.5 and x["downs"] == 1 for x in c.values())
    assert pool.metrics()["hosts_down"] == 2
  finally:
    pool.stop()


def test_live_host_keeps_feeding_and_restarted_host_gets_latest_weights_first():
  pa, pb = portpicker.pick_unused_port(), portpicker.pick_unused_port()
  a, b = FakeHost(pa, "A"), FakeHost(pb, "B")
  queue = TrajectoryQueue(4)
  addr_a, addr_b = f"localhost:{pa}", f"localhost:{pb}"
  pool = client.HostPool([addr_a, addr_b], queue, reconnect_timeout_s=0.3, **FAST)
  w = {"w": np.zeros(3, np.float32)}
  try:
    pool.wait_ready(10)
    assert pool.publish(w, 0) == [addr_a, addr_b]
    pool.start()
    _drain_until(queue, pool, lambda: pool.received[addr_b] and pool.received[addr_a], "both")
    b.stop()  # host B dies; whatever it had queued dies with it
    _drain(queue, 8, pool)
    _until(lambda: not pool.counters()[addr_b]["up"], 10, "B marked down")
    for v in (1, 2, 3):  # the trainer keeps stepping: A feeds it, publish does not raise
      assert pool.publish(w, v) == [addr_a]
      assert all(t.info["host"] == "A" for t in _drain(queue, 4, pool))
    time.sleep(0.5)  # B down > reconnect_timeout_s, but A is up: no error
    pool.check()
    assert pool.is_alive()
    received_b = pool.received[addr_b]

    b = FakeHost(pb, "B2")  # restarted on the same port: version -1, weights lost
    _until(lambda: pool.counters()[addr_b]["up"], 10, "B reconnected")
    assert b.got_versions[0] == 3  # the latest weights were its first
    trajs = _drain_until(queue, pool, lambda: pool.received[addr_b] > received_b, "B again")
    trajs += _drain(queue, 8, pool)
    from_b2 = [t for t in trajs if t.info["host"] == "B2"]
    assert from_b2
    c = pool.counters()[addr_b]
    assert c["reconnects"] == 1 and c["restarts"] == 1 and c["resyncs"] == 1 and c["downs"] == 1
    assert c["version"] == 3 and pool.latest_version == 3
    assert all(t.oldest_version() >= 3 for t in from_b2)
    assert pool.metrics()["hosts_up"] == 2
  finally:
    pool.stop()
    a.stop()
    b.stop()


def test_restart_seen_only_in_a_take_reply_resends_weights_before_the_next_pull():
  port = portpicker.pick_unused_port()
  h = FakeHost(port, "A")
  queue = TrajectoryQueue(2)
  pool = client.HostPool([f"localhost:{port}"], queue, **FAST)
  try:
    pool.publish({"w": np.zeros(3, np.float32)}, 5)
    pool.start()
    _drain(queue, 4, pool)
    h.lose_weights()  # a new process behind the same connection; no call failed
    _drain(queue, 2, pool)  # room: the pump pulls, sees the new instance id
    _until(lambda: pool.counters()[f"localhost:{port}"]["resyncs"] == 1, 10, "re-send")
    assert h.got_versions == [5, 5] and h.version == 5
    c = pool.counters()[f"localhost:{port}"]
    assert c["restarts"] == 1 and c["downs"] == 0 and c["up"]
    assert all(t.oldest_version() == 5 for t in _drain(queue, 4, pool))
  finally:
    pool.stop()
    h.stop()


def test_a_host_refusing_the_weights_is_a_permanent_error():
  port = portpicker.pick_unused_port()
  h = FakeHost(port, "A", refuse_weights=True)
  pool = client.HostPool([f"localhost:{port}"], TrajectoryQueue(2), **FAST)
  try:
    pool.wait_ready(10)
    with pytest.raises(RuntimeError, match=r"refused the weights: UNKNOWN.*weights leaf"):
      pool.publish({"w": np.zeros(3, np.float32)}, 0)
    with pytest.raises(RuntimeError, match="refused the weights"):
      pool.check()
  finally:
    pool.stop()
    h.stop()


# ---- real host subprocesses ----------------------------------------------------------------------
OVERRIDES = host_overrides()


def _config():
  return host_config()


def _start_host(rl_port, index, name, log_path):
  log = open(log_path, "a", encoding="utf-8")  # pylint: disable=consider-using-with
  return subprocess.Popen(
      [sys.executable, "-m", "sao_jax.rollout.host", "--config=configs/arith_tool.py:smoke",
       "--port=0", f"--rl_port={rl_port}", f"--host_index={index}", "--num_hosts=2",
       f"--name={name}", *OVERRIDES], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)


def test_sigkilled_host_is_replaced_by_the_other_then_reconnected_with_latest_weights(tmp_path):
  ports = [portpicker.pick_unused_port(), portpicker.pick_unused_port()]
  addr_a, addr_b = (f"localhost:{p}" for p in ports)
  log = str(tmp_path / "hosts.log")
  procs = [_start_host(ports[0], 0, "A", log), _start_host(ports[1], 1, "B", log)]
  pool = None
  try:
    config = _config()
    task = tasks.make_task(config)
    mcfg = model_config(config, task.tokenizer.vocab_size)
    params0 = nnx.to_pure_dict(nnx.split(Transformer(mcfg, rngs=nnx.Rngs(1)))[1])
    params0 = jax.tree.map(np.asarray, params0)
    batch = config.train.batch_size
    queue = TrajectoryQueue(2)
    pool = client.HostPool([addr_a, addr_b], queue, reconnect_timeout_s=2.0, backoff_s=0.1,
                           max_backoff_s=1.0)
    pool.wait_ready(timeout=180)
    stats, consumed, version = StalenessStats(), [], 0
    pool.publish(params0, 0)
    pool.start()

    def step():  # the trainer: take a batch, "update", publish the next version
      nonlocal version
      trajs, _, _ = take_batch(queue, batch, version, stats=stats, on_empty=pool.check,
                               poll_s=0.2)
      consumed.extend(trajs)
      version += 1
      return pool.publish(jax.tree.map(lambda x: x * (1 + 1e-3 * version), params0), version)

    for _ in range(12):
      step()
      if pool.received[addr_a] and pool.received[addr_b]:
        break
    assert pool.received[addr_a] and pool.received[addr_b], pool.counters()

    procs[1].send_signal(signal.SIGKILL)  # host B dies mid-run
    procs[1].wait(timeout=30)
    steps_at_kill = version
    for _ in range(3):
      step()  # no exception: host A carries on alone
    _until(lambda: not pool.counters()[addr_b]["up"], 30, "B marked down")
    assert step() == [addr_a]  # weights go to the live host only
    received_b, received_a = pool.received[addr_b], pool.received[addr_a]

    # restart B on the same port; watch its Status from its first answer
    procs[1] = _start_host(ports[1], 1, "B-restarted", log)
    seen, done = [], threading.Event()

    def watch():
      with grpc.insecure_channel(addr_b) as ch:
        st = client._stub(ch, "Status")  # pylint: disable=protected-access
        while not done.is_set():
          try:
            m = wire.unpack(st(b"", timeout=5, wait_for_ready=True))
            seen.append((int(m["version"]), int(m["trajectories"])))
          except grpc.RpcError:
            pass
          time.sleep(0.02)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    c_b = lambda: pool.counters()[addr_b]  # noqa: E731
    _until(lambda: c_b()["down_s"] > 2.0 or c_b()["up"], 60, "B down > reconnect_timeout_s")
    pool.check()  # B is down longer than reconnect_timeout_s=2, A is not: no error
    latest = version  # the trainer pauses here, so this stays the latest until B is back
    _until(lambda: pool.counters()[addr_b]["up"], 120, "B reconnected")
    st_b = [s for s in pool.status() if s["address"] == addr_b][0]
    assert st_b["name"] == "B-restarted" and st_b["version"] == latest
    deadline = time.time() + 120  # A feeds the trainer while B compiles its first rollout
    while not (pool.received[addr_b] > received_b
               and any(t.info["host"] == "B-restarted" for t in consumed)):
      assert time.time() < deadline, pool.counters()
      step()
    done.set()
    watcher.join(10)
    c = pool.counters()
    print(f"counters {c}; B's status while restarting (version, trajectories): "
          f"{sorted(set(seen))}; steps {steps_at_kill} at the kill, {version} at the end")
    assert pool.received[addr_b] > received_b and pool.received[addr_a] > received_a
    assert c[addr_b]["reconnects"] == 1 and c[addr_b]["restarts"] == 1
    assert c[addr_b]["resyncs"] >= 1 and c[addr_a]["downs"] == 0
    # Status never showed the restarted host with another policy than the trainer's latest (or
    # newer), and it had produced nothing while it still had no weights
    assert seen and all(v == -1 or v >= latest for v, _ in seen), seen
    assert all(n == 0 for v, n in seen if v == -1), seen
    from_b2 = [t for t in consumed if t.info["host"] == "B-restarted"]
    assert from_b2 and all(t.oldest_version() >= latest for t in from_b2)
    assert stats.accepted == len(consumed) == version * batch  # only consumed ones counted
    pool.check()
    assert pool.is_alive()
  finally:
    if pool is not None:
      pool.stop()
    for p in procs:
      if p.poll() is None:
        p.terminate()
        try:
          p.wait(timeout=30)
        except subprocess.TimeoutExpired:
          p.kill()
          p.wait()
    if sys.exc_info()[0] is not None and os.path.exists(log):
      with open(log, encoding="utf-8") as f:
        print(f.read()[-4000:])
