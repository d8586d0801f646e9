"""``RolloutActor``: one Ray rollout process of ``RaySource`` (``rollout/ray_source.py``).

It builds the trainer's policy *structure* (``nnx.eval_shape`` of the same ``Transformer``: no
random init), the task, the guarded env and an ``SAOEngine``, runs a ``RolloutWorker`` on a
thread, and admits nothing before its first weights arrive.

Weights are pulled on a thread of their own (``set_weights`` only queues the ref), bucket by
bucket into the engine's parameter shardings, while the worker keeps decoding and ``poll`` keeps
handing over finished trajectories; the worker swaps to a version between engine calls, once
every bucket of it has landed (``WeightStore``), so one engine call never mixes versions.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import threading
import time
import uuid
from typing import Optional

from sao_jax.rollout import weight_sync
from sao_jax.rollout.trajectory import Trajectory
from flax import nnx
from sao_jax import build, roles, tasks
from sao_jax.models.transformer import Transformer
from sao_jax.rollout.sync import WeightStore
from sao_jax.rollout.worker import RolloutWorker


class RolloutActor:
  """One rollout process (wrapped by ``ray.remote`` in ``RaySource``; a plain class here).

  Args:
    run: the run's typed ``roles.Run`` (task, rollout, model, seed fields are read; the
      objects are built by ``sao_jax/build.py``, as in the trainer's process).
    model_config: the trainer's ``ModelConfig`` (the policy structure; weights come by sync).
    index: this actor's index in the source (seeds its sampling: ``config.seed + index``).

  Methods (all return quickly; the pull runs on the actor's pull thread):
    ``set_weights(ref)``, ``submit(incarnation, items)``, ``poll(timeout_s, layout)``, ``pid()``,
    ``stop()``.
  """

  def __init__(self, run: roles.Run, model_config, index: int):
    if not isinstance(run, roles.Run):
      raise TypeError(f"RolloutActor takes a roles.Run, got {type(run).__name__}")
    config = run
    self.index = int(index)
    self.incarnation = uuid.uuid4().hex
    self.config = config
    self.task = tasks.make_task(config)
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(model_config,
                                                                      rngs=nnx.Rngs(0))))
    self.expected = nnx.to_pure_dict(abstract)  # ShapeDtypeStruct leaves: the received tree
    seed = int(config.seed) + self.index
    self.engine = build.make_engine(config, model_config, graphdef, self.task.tokenizer,
                                    slots=config.rollout.slots,
                                    temperature=config.rollout.temperature, seed=seed)
    self.env, self.env_workers = build.rollout_env(config, self.task.env, seed)
    self.seed = seed
    self.puller = weight_sync.WeightPuller(self._param_shardings())
    self.layout = self.puller.layout(weight_sync.avals_of(self.expected))
    self._layout_sent = False
    self._pulls: collections.deque = collections.deque()  # WeightRefs queued, oldest first
    self._pull_thread: Optional[threading.Thread] = None
    self.store = None  # WeightStore, created by the first set_weights
    self.first_serve_version = -1  # policy version when this incarnation admitted its 1st prompt
    self.pull_s = 0.0
    self._inbox: collections.deque = collections.deque()
    # ledger position -> tickets of the hand-outs admitted at it (FIFO): a trajectory carries its
    # position, unique per hand-out (the copies of one GRPO group share it and are
    # interchangeable); a problem id is not unique (the same problem in two epochs)
    self._tickets: dict[int, collections.deque] = collections.defaultdict(collections.deque)
    self._out: list = []
    self._cond = threading.Condition()
    self._stop = threading.Event()
    self._error: Optional[BaseException] = None
    self._worker = None
    self._thread: Optional[threading.Thread] = None

  # ---- control calls --------------------------------------------------------------------------
  def set_weights(self, ref: weight_sync.WeightRef) -> int:
    """Queues ``ref`` for the pull thread and returns at once (this actor's current version).
    The pull lands bucket by bucket; the worker picks the version up once all of it landed (the
    first one starts the worker). Raises ``WeightMismatchError`` if the tree does not match the
    actor's model (before any bytes move); a failed pull is raised by the next ``poll``."""
    weight_sync.check_matches(ref, self.expected)
    with self._cond:
      self._pulls.append(ref)
      if self._pull_thread is None:
        self._pull_thread = threading.Thread(target=self._pull_loop, name="rollout-actor-pull",
                                             daemon=True)
        self._pull_thread.start()
      self._cond.notify_all()
    return self.store.version if self.store is not None else -1

  def _param_shardings(self) -> list:
    """The engine's parameter shardings, one per leaf of ``self.expected`` (treedef order):
    ``engine.param_shardings(params)`` (the engine's tensor/expert layout) when it has them,
    else replicated on the engine's mesh."""
    import jax  # pylint: disable=import-outside-toplevel
    if hasattr(self.engine, "param_shardings"):
      return jax.tree.leaves(self.engine.param_shardings(self.expected),
                             is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
    n = len(jax.tree.leaves(self.expected))
    return [jax.sharding.NamedSharding(self.engine.mesh, jax.sharding.PartitionSpec())] * n

  def _pull_loop(self) -> None:
    """The pull thread: pulls the queued refs in order (a ref older than the version held is
    skipped without moving bytes) and publishes each landed version to the worker."""
    while not self._stop.is_set():
      with self._cond:
        if not self._pulls:
          self._cond.wait(0.2)
          continue
        ref = self._pulls.popleft()
      try:
        t0 = time.perf_counter()
        params = self.puller.pull(ref)
        self.pull_s += time.perf_counter() - t0
        if params is not None:
          if self.store is None:
            self.store = WeightStore(params, ref.version)
            self._start_worker()
          else:
            self.store.publish(params, ref.version)
      except BaseException as e:  # pylint: disable=broad-except  (reported by the next poll)
        with self._cond:
          self._error = e
          self._cond.notify_all()
        return

  def submit(self, incarnation: str, items: list) -> int:
    """Queues ``items`` (``[(ticket, Handout)]``: ledger hand-outs) for rollout. Items meant for
    another incarnation (sent before the driver saw this one start) are ignored: the driver
    issues them again. Returns the number of prompts queued here and not yet finished."""
    with self._cond:
      if incarnation == self.incarnation:
        self._inbox.extend(items)
      return len(self._inbox) + sum(len(q) for q in self._tickets.values())

  def poll(self, timeout_s: float = 0.2, layout: bool = False) -> dict:
    """Finished trajectories, waiting up to ``timeout_s`` for at least one.

    Returns ``{"incarnation", "version" (-1 before weights), "first_serve_version",
    "trajectories": [(ticket, Trajectory)], "stats": WorkerStats fields, "pull_s", "pulling"
    (version being pulled, -1 none), "buckets_done" (its buckets landed)}``, and ``"layout"``
    (``weight_sync.layout`` of this actor's devices) when asked or in this incarnation's first
    reply. Re-raises the rollout worker's or the pull thread's error, if it died of one."""
    with self._cond:
      if not self._out and self._error is None:
        self._cond.wait(timeout_s)
      out, self._out = self._out, []
    if self._error is not None:
      raise self._error
    stats = dataclasses.asdict(self._worker.stats) if self._worker is not None else {}
    send_layout, self._layout_sent = layout or not self._layout_sent, True
    return {"incarnation": self.incarnation,
            "version": self.store.version if self.store is not None else -1,
            "first_serve_version": self.first_serve_version, "trajectories": out,
            "stats": stats, "pull_s": self.pull_s, "pulling": self.puller.pulling,
            "buckets_done": self.puller.buckets_done,
            **({"layout": self.layout} if send_layout else {})}

  def pid(self) -> int:
    return os.getpid()

  def stop(self) -> None:
    self._stop.set()
    for t in (self._thread, self._pull_thread):
      if t is not None:
        t.join(timeout=10)

  # ---- the rollout worker ---------------------------------------------------------------------
  def _problems(self):
    """The worker's problem iterator: the next queued item, or None (nothing to admit now)."""
    while True:
      with self._cond:
        item = self._inbox.popleft() if self._inbox else None
        if item is not None:
          ticket, problem = item
          self._tickets[problem.position].append(ticket)
          if self.first_serve_version < 0:
            self.first_serve_version = self.store.version
      yield None if item is None else problem

  def _sink(self, traj: Trajectory) -> bool:
    with self._cond:
      ticket = self._tickets[traj.prompt_position].popleft()
      if not self._tickets[traj.prompt_position]:
        del self._tickets[traj.prompt_position]
      self._out.append((ticket, traj))
      self._cond.notify_all()
    return not self._stop.is_set()

  def _start_worker(self) -> None:
    cfg = self.config
    self._worker = RolloutWorker(
        self.engine, self.env, self._problems(), self._sink, self.store,
        stop_ids=self.task.stop_ids, seed=self.seed, env_workers=self.env_workers,
        stop_strings=self.task.stop_strings, **build.worker_kwargs(cfg))

    def run():
      try:
        self._worker.run(self._stop)
      except BaseException as e:  # pylint: disable=broad-except  (reported by the next poll)
        with self._cond:
          self._error = e
          self._cond.notify_all()

    self._thread = threading.Thread(target=run, name="rollout-actor-worker", daemon=True)
    self._thread.start()
