"""The inference host: JetStream serving plus a disaggregated RL rollout service.

``python -m sao_jax.rollout.host --config=configs/arith_tool.py --port=9000 [--rl_port=9001]
[--weights_dir=/shared/weights] [--host_index=0 --num_hosts=1]``

One process, two gRPC servers, one set of weights:

* ``--port``: JetStream's own server (``jetstream.core.server_lib.run``: orchestrator Driver with
  prefill / generate / detokenize threads and the ``Orchestrator`` service). JetStream's client
  API (``jetstream_pb2_grpc.OrchestratorStub(channel).Decode``) does plain generation against it
  (evaluation, serving), text or token ids in, token ids (and text) out.
* ``--rl_port`` (default ``port + 1``): the ``sao_jax.RolloutHost`` service (``wire.py``). A
  ``RolloutWorker`` drives its own ``SAOEngine`` over the task's multi-turn environment with
  continuous batching and hands finished trajectories -- per-token ids, engine log-probs and
  policy versions -- to the trainer (``client.HostPool``). It starts once the trainer has
  published weights (version >= 0).

Weights: the host starts with the config's random init as version -1 (serving only). The trainer
publishes ``(params, version)`` over gRPC (``PublishWeights``) or writes them to a shared path
(``--weights_dir``, polled every ``--poll_s``); both land in one ``WeightStore``. The rollout
worker and JetStream's generate thread pick up the newest version between generate steps
(in-flight updates), so JetStream serving also follows training.

Restart: a host that is killed and started again (same address) comes back at version -1 with a
new ``instance`` id (in every ``Take`` / ``Status`` / ``PublishWeights`` reply); the trainer's
``HostPool`` notices, re-sends its latest ``(params, version)`` and only then pulls again, so a
restarted host never samples with its random init. Trajectories still queued in a killed host
are lost with it (the trainer never counted them).
"""

from __future__ import annotations

import itertools
import json
import logging
import queue as queue_lib
import threading
import time
import uuid
from concurrent import futures
from typing import Any, Optional

import grpc
import jax
import numpy as np
from flax import nnx

from sao_jax import pretrained
from sao_jax.rollout import jetstream_compat
from sao_jax.rollout import wire
from sao_jax.rollout.engine import SAOEngine
from sao_jax.rollout.staleness import AdmissionControl, check_policy
from sao_jax.rollout.sync import TrajectoryQueue, WeightStore
from sao_jax.rollout.worker import RolloutWorker, env_workers_for


class LiveWeightsEngine(SAOEngine):
  """``SAOEngine`` whose ``params`` may be a ``WeightStore``: each prefill / generate call uses
  the store's newest params. Lets JetStream's orchestrator (which loads params once, at start)
  follow the trainer's weight updates between generate steps."""

  def __init__(self, *args, store: WeightStore, **kwargs):
    super().__init__(*args, **kwargs)
    self.store = store

  def _resolve(self, params):
    return self.store.latest()[0] if isinstance(params, WeightStore) else params

  def load_params(self, params=None, *args, **kwargs):  # pylint: disable=arguments-differ
    return self.store if params is None else params

  def prefill(self, *, params, **kwargs):
    return super().prefill(params=self._resolve(params), **kwargs)

  def generate(self, params, decode_state, temperature=None):
    return super().generate(self._resolve(params), decode_state, temperature)


def _cycle(problems, seed):
  rng = np.random.default_rng(seed)
  for _ in itertools.count():
    for i in rng.permutation(len(problems)):
      yield problems[i]


class RolloutHost:
  """Everything one inference host runs; ``start()`` / ``stop()``. Usable in-process (tests).

  Args:
    config: the experiment's ``ml_collections`` config (model, task, rollout fields).
    port: JetStream server port (0: do not start JetStream serving).
    rl_port: RolloutHost service port.
    weights_dir: shared checkpoint path to poll for weights ("" = none).
    host_index / num_hosts: this host's index among ``num_hosts`` (problem-order seed, share of
      the admission budget).
    name: host name recorded in every trajectory's ``info["host"]``.
  """

  def __init__(self, config, *, port: int, rl_port: int, weights_dir: str = "",
               host_index: int = 0, num_hosts: int = 1, name: str = "", poll_s: float = 0.2):
    from sao_jax import tasks  # pylint: disable=import-outside-toplevel
    from sao_jax.models.transformer import Transformer  # pylint: disable=import-outside-toplevel
    self.config, self.port, self.rl_port = config, port, rl_port
    self.weights_dir, self.poll_s = weights_dir, poll_s
    self.name = name or f"host{host_index}:{rl_port}"
    # new on every start: lets the trainer tell a restarted host (weights lost) from a live one
    self.instance = uuid.uuid4().hex
    self.task = tasks.make_task(config)
    self.mcfg = pretrained.model_config(config, self.task.tokenizer.vocab_size)
    graphdef, params = nnx.split(Transformer(self.mcfg, rngs=nnx.Rngs(config.seed)))
    self.like = nnx.to_pure_dict(params)
    self.store = WeightStore(self.like, version=-1)
    self._publish_lock = threading.Lock()
    r = config.rollout
    policy = r.get("staleness_policy", "none")
    max_staleness = r.get("max_staleness", None)
    check_policy(policy, max_staleness)
    admission = None
    if "admission" in policy:  # this host's share of the trainer's batch
      share = -(-config.train.batch_size // num_hosts)
      admission = AdmissionControl(max_staleness, share)
    self.queue = TrajectoryQueue(r.queue_size)
    self.stop_event = threading.Event()
    self.engine = SAOEngine(self.mcfg, graphdef, self.task.tokenizer,
                            max_concurrent_decodes=r.slots,
                            max_prefill_length=r.max_prefill_length,
                            temperature=r.temperature, seed=config.seed + 7919 * host_index)
    self.serve_engine = LiveWeightsEngine(
        self.mcfg, graphdef, self.task.tokenizer, store=self.store,
        max_concurrent_decodes=r.get("serve_slots", 8), max_prefill_length=r.max_prefill_length,
        temperature=r.temperature, seed=config.seed)
    self.worker = RolloutWorker(
        self.engine, self.task.env, _cycle(self.task.train_problems, config.seed + host_index),
        lambda t: self.queue.put(t, self.stop_event), self.store, stop_ids=self.task.stop_ids,
        max_new_tokens=r.max_new_tokens, max_seq_len=config.model.max_seq_len,
        seed=config.seed + host_index, kv_on_update=r.get("kv_on_update", "keep"),
        admission=admission, env_workers=env_workers_for(config),
        stop_strings=self.task.stop_strings)
    self.jetstream_server = None
    self.rl_server = None
    self._threads: list[threading.Thread] = []

  # ---- RolloutHost service -----------------------------------------------------------------------
  def _take(self, request: bytes, context):
    """Up to ``max_items`` finished trajectories; waits up to ``timeout_s`` for the first.
    The reply also carries this host's weights ``version`` and ``instance`` id."""
    del context
    req = wire.unpack(request)
    items = []
    deadline = time.time() + float(req.get("timeout_s", 1.0))
    while len(items) < int(req.get("max_items", 1)):
      wait = deadline - time.time() if not items else 0.0
      try:
        traj, _ = self.queue.get(timeout=max(wait, 0.0)) if wait > 0 else self.queue.get_nowait()
      except queue_lib.Empty:
        break
      items.append(wire.trajectory_to_dict(traj, self.name))
    return wire.pack({"items": {str(i): x for i, x in enumerate(items)},
                      "version": self.store.version, "instance": self.instance})

  def _offer(self, params, version: int) -> None:
    """Publishes ``(params, version)`` if newer than the store's; older or equal versions (a
    trainer re-sending after a reconnect, gRPC and ``--weights_dir`` racing) are ignored."""
    with self._publish_lock:
      if version > self.store.version:
        self.store.publish(params, version)

  def _publish(self, request: bytes, context):
    del context
    params, version = wire.params_from_bytes(request, self.like)
    self._offer(params, version)
    return wire.pack({"version": self.store.version, "instance": self.instance})

  def _status(self, request: bytes, context):
    del request, context
    s = self.worker.stats
    return wire.pack({"version": self.store.version, "trajectories": s.trajectories,
                      "tokens_sampled": s.tokens_sampled, "queue_size": self.queue.qsize(),
                      "weight_updates": s.weight_updates, "name": self.name,
                      "instance": self.instance,
                      "worker_error": repr(self.worker.error) if self.worker.error else ""})

  def _rl_handler(self):
    ident = lambda b: b  # noqa: E731  bodies are msgpack bytes, (de)serialized by hand
    return grpc.method_handlers_generic_handler(wire.SERVICE, {
        "Take": grpc.unary_unary_rpc_method_handler(
            self._take, request_deserializer=ident, response_serializer=ident),
        "PublishWeights": grpc.unary_unary_rpc_method_handler(
            self._publish, request_deserializer=ident, response_serializer=ident),
        "Status": grpc.unary_unary_rpc_method_handler(
            self._status, request_deserializer=ident, response_serializer=ident),
    })

  # ---- threads -----------------------------------------------------------------------------------
  def _run_worker(self):
    while self.store.version < 0 and not self.stop_event.is_set():
      time.sleep(0.05)
    self.worker.params, self.worker.version = self.store.latest()
    self.worker.run(self.stop_event)

  def _poll_weights(self):
    while not self.stop_event.wait(self.poll_s):
      got = wire.read_latest_weights(self.weights_dir, self.like, self.store.version)
      if got is not None:
        self._offer(*got)

  def start(self) -> "RolloutHost":
    self.rl_server = grpc.server(futures.ThreadPoolExecutor(max_workers=16),
                                 options=wire.GRPC_OPTIONS)
    self.rl_server.add_generic_rpc_handlers((self._rl_handler(),))
    self.rl_server.add_insecure_port(f"[::]:{self.rl_port}")
    self.rl_server.start()
    if self.port:
      server_lib = jetstream_compat.server_lib()
      config_lib = jetstream_compat.config_lib()
      engine = self.serve_engine
      cfg = config_lib.ServerConfig(interleaved_slices=("cpu=1",),
                                    interleaved_engine_create_fns=(lambda devices: engine,))
      self.jetstream_server = server_lib.run(port=self.port, config=cfg,
                                             devices=jax.devices()[:1], threads=16)
    targets = [self._run_worker] + ([self._poll_weights] if self.weights_dir else [])
    for fn in targets:
      t = threading.Thread(target=fn, daemon=True, name=f"{self.name}-{fn.__name__}")
      t.start()
      self._threads.append(t)
    return self

  def stop(self) -> None:
    self.stop_event.set()
    if self.rl_server is not None:
      self.rl_server.stop(grace=1)
    if self.jetstream_server is not None:
      self.jetstream_server.stop()
    for t in self._threads:
      t.join(timeout=10)


def main(argv) -> None:
  del argv
  from absl import flags  # pylint: disable=import-outside-toplevel
  f = flags.FLAGS
  logging.getLogger().setLevel(logging.WARNING)
  host = RolloutHost(f.config, port=f.port, rl_port=f.rl_port or f.port + 1,
                     weights_dir=f.weights_dir, host_index=f.host_index, num_hosts=f.num_hosts,
                     name=f.name).start()
  print(json.dumps({"ready": True, "port": f.port, "rl_port": host.rl_port,
                    "name": host.name}), flush=True)
  try:
    while True:
      time.sleep(1.0)
      if host.worker.error is not None:
        raise SystemExit(f"rollout worker failed: {host.worker.error!r}")
  finally:
    host.stop()


def _define_flags() -> None:
  from absl import flags  # pylint: disable=import-outside-toplevel
  from ml_collections import config_flags  # pylint: disable=import-outside-toplevel
  config_flags.DEFINE_config_file("config", None, "experiment config (model, task, rollout).")
  flags.DEFINE_integer("port", 9000, "JetStream Orchestrator gRPC port (0 = no serving).")
  flags.DEFINE_integer("rl_port", 0, "sao_jax.RolloutHost gRPC port (0 = port + 1).")
  flags.DEFINE_string("weights_dir", "", "shared checkpoint path to poll for weights.")
  flags.DEFINE_integer("host_index", 0, "index of this host among --num_hosts.")
  flags.DEFINE_integer("num_hosts", 1, "number of rollout hosts feeding the trainer.")
  flags.DEFINE_string("name", "", "host name recorded in trajectories (default host<i>:<port>).")
  flags.mark_flag_as_required("config")


if __name__ == "__main__":
  from absl import app  # pylint: disable=import-outside-toplevel
  _define_flags()
  app.run(main)
