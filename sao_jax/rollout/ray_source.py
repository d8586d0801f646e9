"""``RaySource``: the ``TrajectorySource`` whose rollouts run in Ray actors
(``rollout.backend="ray"``).

Shape (``docs/architecture.md``): Ray starts and supervises N ``RolloutActor`` processes
(resources per actor from the config) and carries the control calls; weights move through
``rollout.weight_sync`` (``jax.experimental.transfer`` pulls, or the Ray object store); the
driver keeps the prompt ledger, so accounting stays exactly-once across actor deaths.

Each actor builds the trainer's policy *structure* (``nnx.eval_shape`` of the same
``Transformer(model_config)``: no random init), the task (``tasks.make_task`` from the typed
run), the env and the ``SAOEngine`` (``sao_jax/build.py``), and runs today's ``RolloutWorker``
(continuous batching, multi-turn env, per-token ``logprobs`` and ``policy_version``) on a thread.
It admits nothing before its first weights arrive, so a (re)started actor always serves the
newest version the driver published.

Flow (pull-based, bounded): the driver hands each actor ``(ticket, Problem)`` items from its
ledger until the actor holds ``max_outstanding`` unfinished prompts, and never has more than
``rollout.queue_size`` prompts in flight or finished-but-not-taken in all (the thread backend's
bounded queue: back-pressure, so rollouts do not run ahead of the learner), and polls
each actor for finished trajectories (one poll in flight per actor). Every item carries a ticket
unique in the run; the driver tracks the tickets outstanding at each actor.

Weights: ``publish`` only registers the version (``WeightPublisher``; the object store also puts
it) and never waits for an actor. An actor is sent a ``WeightRef`` (buckets of the slices its
devices hold, ``rollout.weight_bucket_mb``) when it holds no pull in flight; it pulls on its own
thread while it keeps serving and answering polls, and reports the version once all of it
landed. A version published while an actor still pulls an older one waits for that pull to
finish (the older one is not abandoned half-way: its armed pulls would leak); the actor then
gets the newest, skipping those in between.

Faults: an actor that dies (SIGKILL, OOM, node loss) is restarted by Ray (``max_restarts``);
its outstanding tickets are issued again, first, to whichever actor has room; the restarted
incarnation (detected by a new incarnation id in its replies, or by the failed call) receives
the newest weights before any prompt (Ray runs one caller's calls to an actor in order). The
other actors keep serving meanwhile. A ticket that comes back twice is dropped (counted in
``duplicates``). An error raised *inside* an actor (a model mismatch, a prompt too long, a bug)
is not transient: ``take`` re-raises it at once as its own exception type.

``take`` is the thread backend's take loop (``rollout.assembler.BatchAssembler``: groups, the
grpo_sync barrier, the staleness policy, the ledger, length statistics, metric names); this
module is the transport around it. Its ``AdmissionControl`` is asked before each hand-out (with
the driver's policy version) and told when a trajectory comes back.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import time
from typing import Any, Optional


from sao_jax import roles
from sao_jax.rollout import ray_local, weight_sync
from sao_jax.rollout.assembler import Arrival, BatchAssembler
from sao_jax.rollout.trajectory import Trajectory


from sao_jax.rollout.ray_actor import RolloutActor


# ---------------------------------------------------------------------------------------------
# the driver side
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass
class _Actor:
  """Driver-side record of one actor (handle survives Ray restarts)."""
  handle: Any
  index: int
  incarnation: Optional[str] = None    # last incarnation id seen in a reply
  version: int = -1                    # weights version it reported
  sent_version: int = -1               # newest version sent to this incarnation
  outstanding: dict = dataclasses.field(default_factory=dict)  # ticket -> problem
  poll_ref: Any = None
  sync_ref: Any = None                 # the set_weights call in flight (returns at once)
  pull_wref: Any = None                # the WeightRef it is pulling, until that version landed
  layout: Any = None                   # its devices' weight layout (weight_sync.layout)
  has_layout: bool = False             # layout received from this incarnation
  pulling: int = -1                    # version its pull thread reported in progress
  buckets_done: int = 0                # buckets of that pull landed (last reply)
  retry_at: float = 0.0
  failures: int = 0                    # consecutive failed calls
  trajectories: int = 0
  restarts: int = 0
  first_serve_version: int = -1
  pid: int = -1


class RaySource:
  """``TrajectorySource`` over ``rollout.num_workers`` Ray rollout actors.

  Args:
    config: the run's typed ``roles.Run`` (TypeError for anything else). Read:
      ``rollout.num_workers``,
      ``rollout.ray_address`` ("" = start a local Ray listening on 127.0.0.1 only, else join
      it), ``rollout.ray_num_cpus``, ``rollout.ray_num_gpus``, ``rollout.ray_resources`` (dict,
      e.g. ``{"TPU": 4}``), ``rollout.ray_max_restarts``, ``rollout.ray_max_outstanding`` (0 = 2 x
      ``rollout.slots``: prompts one actor holds at a time), ``rollout.weight_sync`` ("auto" |
      "transfer" | "object_store"), and everything ``RolloutActor`` reads.
    model_config: the trainer's ``ModelConfig``.
    ledger: the driver's ``PromptLedger`` (hands out ``Handout``s; ``consume(positions)``).
    params: the initial policy params (pytree of arrays; the trainer's copy, not donated).
    version: their policy version.
    group_size: rollouts per prompt (the grpo modes; 1 = SAO).
    synchronous: the grpo_sync barrier (prompts for batch n+1 only after step n is published).
    batch_size: trajectories per step (the barrier's release, the admission budget).
    staleness_policy / max_staleness: ``rollout.staleness_policy`` and eta (``BatchAssembler``).
    run_dir: where ``ledger.jsonl`` is appended ("" = not written).

  Raises ValueError for a bad ``rollout.num_workers`` / ``rollout.weight_sync`` or a bad
  staleness policy (``BatchAssembler``).
  """

  def __init__(self, config, model_config, ledger, params, version: int = 0, *,
               group_size: int = 1, synchronous: bool = False, batch_size: int = 0,
               staleness_policy: str = "none", max_staleness: int = -1, run_dir: str = ""):
    import ray  # pylint: disable=import-outside-toplevel  (optional: only the ray backend)
    self._ray = ray
    self.assembler = BatchAssembler(
        ledger, batch_size=batch_size, group_size=group_size, synchronous=synchronous,
        staleness_policy=staleness_policy, max_staleness=max_staleness, run_dir=run_dir)
    self.admission = self.assembler.admission
    self._t_last = (0, time.time())
    if not isinstance(config, roles.Run):
      raise TypeError(f"RaySource takes a roles.Run, got {type(config).__name__}")
    run = config
    r = run.rollout  # typed: one default per field (sao_jax/roles.py)
    n = r.num_workers
    if n < 1:
      raise ValueError(f"rollout.num_workers={n}; need >= 1 rollout actor.")
    self._owns_ray = False
    if not ray.is_initialized():
      # "" (a laptop run): a local Ray with every port on 127.0.0.1 (rollout/ray_local.py);
      # else the user's cluster, whose ports and access are its own (README)
      ray_local.init_ray(r.ray_address, log_to_driver=True)
      self._owns_ray = True
    self.ledger = ledger
    self.max_outstanding = int(r.ray_max_outstanding) or 2 * int(r.slots)
    self.queue_size = int(r.queue_size)
    transport = weight_sync.resolve_transport(r.weight_sync)
    self.publisher = weight_sync.WeightPublisher(
        transport, bucket_bytes=int(float(r.weight_bucket_mb) * 2 ** 20))
    self.publisher.publish(params, version)
    self.version = int(version)
    self._tickets = itertools.count()
    self._reissue: collections.deque = collections.deque()   # (ticket, problem) to hand out first
    self._arrived: collections.deque = collections.deque()   # (finished, monotonic s), not taken
    self.handed_out: set = set()
    self.returned: set = set()
    self.counters = collections.Counter()
    resources = dict(r.ray_resources or {})
    cls = ray.remote(RolloutActor).options(
        num_cpus=float(r.ray_num_cpus),
        num_gpus=float(r.ray_num_gpus), resources=resources or None,
        max_restarts=int(r.ray_max_restarts), max_task_retries=0,
        max_concurrency=1)
    self.actors = [_Actor(cls.remote(run, model_config, i), i) for i in range(n)]

  # ---- TrajectorySource -----------------------------------------------------------------------
  def publish(self, params, version: int) -> None:
    """Makes ``params`` the newest weights and returns without waiting for any actor; each
    actor pulls them as soon as its previous pull is done (newest wins: versions published
    meanwhile are skipped)."""
    self.publisher.publish(params, version)
    self.version = int(version)
    self.assembler.published(version)  # grpo_sync: the next batch starts on the new weights
    self._pump()

  @property
  def lengths(self):
    """Generated / trained / dropped response lengths (``assembler.LengthStats``)."""
    return self.assembler.lengths

  @property
  def last_positions(self) -> list:
    """Ledger positions the last ``take`` consumed."""
    return self.assembler.last_positions

  def take(self, n: int, policy_version: int) -> list[Trajectory]:
    """``n`` trajectories (whole groups) through ``BatchAssembler.take``: groups,
    drop-on-arrival, ledger consumption (positions in ``self.last_positions``).

    Raises the actors' own error when one fails inside (non-transient), and RuntimeError when
    every actor is gone for good."""
    self.version = max(self.version, int(policy_version))
    return self.assembler.take(n, policy_version, self._next_arrival)

  def _next_arrival(self) -> Arrival:
    """The oldest trajectory the actors returned and its wait (s) on the driver; else feeds the
    actors (weights, prompts, polls), waits up to 0.5 s for replies and returns None."""
    if self._arrived:
      traj, t = self._arrived.popleft()
      return traj, time.monotonic() - t
    self._pump()
    self._wait_and_collect(timeout_s=0.5)
    return None

  def metrics(self) -> dict[str, float]:
    """Rollout counters: per actor ``ray/actor{i}_trajectories``, ``_version``, ``_restarts``;
    totals ``ray/restarts``, ``ray/reissued``, ``ray/duplicates``, ``ray/outstanding``; and the
    thread backend's names (the take loop's ``BatchAssembler.metrics`` among them)."""
    m = {}
    for a in self.actors:
      m[f"ray/actor{a.index}_trajectories"] = float(a.trajectories)
      m[f"ray/actor{a.index}_version"] = float(a.version)
      m[f"ray/actor{a.index}_restarts"] = float(a.restarts)
      m[f"ray/actor{a.index}_pulling"] = float(a.pulling)
    m["ray/restarts"] = float(sum(a.restarts for a in self.actors))
    m["ray/outstanding"] = float(sum(len(a.outstanding) for a in self.actors) + len(self._reissue))
    for k in ("reissued", "duplicates"):
      m[f"ray/{k}"] = float(self.counters[k])
    # the thread backend's names, so the driver logs the same columns
    trajs = sum(a.trajectories for a in self.actors)
    tokens, now = sum(self.lengths.generated), time.time()
    last_tokens, t_last = self._t_last
    self._t_last = (tokens, now)
    m.update(rollout_trajectories=float(trajs),
             tokens_per_s=(tokens - last_tokens) / max(now - t_last, 1e-9),
             env_errors_total=float(self.counters["env_errors"]), **self.assembler.metrics())
    return m

  def state(self) -> dict:
    """Checkpoint state: the ledger's cursor."""
    return self.ledger.state()

  def close(self) -> None:
    """Kills the actors (no restart), drops the published weights, stops a Ray this source
    started."""
    for a in self.actors:
      try:
        self._ray.kill(a.handle, no_restart=True)
      except Exception:  # pylint: disable=broad-except  (already gone)
        pass
    self.actors = []
    self.publisher.close()
    if self._owns_ray:
      self._ray.shutdown()

  # ---- internals ------------------------------------------------------------------------------
  def outstanding_tickets(self) -> set:
    """Tickets handed out and not yet returned (at actors or waiting to be issued again)."""
    out = {t for a in self.actors for t in a.outstanding}
    return out | {t for t, _ in self._reissue}

  def _next_item(self):
    if self._reissue:
      self.counters["reissued"] += 1
      return self._reissue.popleft()
    if self.admission is not None and not self.admission.try_start(self.version):
      return None
    handout = next(self.assembler.problems)
    if handout is None:  # the grpo_sync barrier: nothing released yet
      if self.admission is not None:
        self.admission.finish(accepted=False)
      return None
    ticket = next(self._tickets)
    self.handed_out.add(ticket)
    return ticket, handout

  def _pump(self) -> None:
    """Weights to actors that lack the newest (one pull in flight each: sent only once the
    previous version landed), prompts up to the bound to actors that were sent weights, a poll in
    flight for every reachable actor."""
    ray = self._ray
    now = time.monotonic()
    for a in self.actors:
      if a.sync_ref is not None:
        done, _ = ray.wait([a.sync_ref], timeout=0)
        if done:
          self._on_sync_done(a)
      if a.poll_ref is None and now >= a.retry_at:
        a.poll_ref = a.handle.poll.remote(0.2, not a.has_layout)
      if a.incarnation is None:
        continue  # not heard from this incarnation yet
      if a.pull_wref is not None and a.version >= a.pull_wref.version:
        a.pull_wref = None  # landed
      if (a.sync_ref is None and a.pull_wref is None and a.has_layout
          and a.sent_version < self.publisher.version):
        a.pull_wref = self.publisher.ref_for(a.layout)
        a.sync_ref = a.handle.set_weights.remote(a.pull_wref)
        a.sent_version = a.pull_wref.version
      if a.sent_version < 0:
        continue
      items = []
      room = (self.queue_size - len(self._arrived) - len(self._reissue)
              - sum(len(b.outstanding) for b in self.actors))
      while len(a.outstanding) + len(items) < self.max_outstanding and len(items) < room:
        item = self._next_item()
        if item is None:
          break
        items.append(item)
      if items:
        a.handle.submit.remote(a.incarnation, items)
        a.outstanding.update(items)

  def _on_sync_done(self, a: _Actor) -> None:
    ref = a.sync_ref
    a.sync_ref = None
    try:
      a.version = max(a.version, self._ray.get(ref))
    except self._ray.exceptions.RayTaskError as e:  # raised inside the actor: not transient
      raise (e.cause if isinstance(e.cause, BaseException) else e) from e
    except self._ray.exceptions.RayError:  # died before queueing the pull: free the armed pulls
      self._drain(a, 0)

  def _drain(self, a: _Actor, first_bucket: int) -> None:
    """Frees the armed pulls of ``a``'s unfinished weight pull from ``first_bucket`` on."""
    if a.pull_wref is not None and a.version < a.pull_wref.version:
      self.publisher.drain(a.pull_wref, first_bucket)
    a.pull_wref = None

  def _wait_and_collect(self, timeout_s: float) -> None:
    ray = self._ray
    by_ref = {a.poll_ref: a for a in self.actors if a.poll_ref is not None}
    if not by_ref:
      time.sleep(min(timeout_s, 0.1))
      return
    done, _ = ray.wait(list(by_ref), num_returns=1, timeout=timeout_s)
    for ref in done:
      a = by_ref[ref]
      a.poll_ref = None
      try:
        reply = ray.get(ref)
      except ray.exceptions.RayTaskError as e:  # the actor's worker failed: not transient
        raise (e.cause if isinstance(e.cause, BaseException) else e) from e
      except ray.exceptions.RayError:  # dead / restarting: issue its prompts again, retry later
        self._on_lost(a)
        continue
      a.failures = 0
      if reply["incarnation"] != a.incarnation:
        if a.incarnation is not None:  # restarted without us seeing a failed call
          self._on_lost(a, restarted=True)
        a.incarnation, a.sent_version, a.version = reply["incarnation"], -1, -1
        a.layout, a.has_layout = None, False
      if "layout" in reply:
        a.layout, a.has_layout = reply["layout"], True
      a.version = max(a.version, reply["version"])
      a.pulling, a.buckets_done = reply.get("pulling", -1), reply.get("buckets_done", 0)
      a.first_serve_version = reply["first_serve_version"]
      for ticket, traj in reply["trajectories"]:
        a.outstanding.pop(ticket, None)
        if ticket in self.returned:
          self.counters["duplicates"] += 1
          continue
        self.returned.add(ticket)
        a.trajectories += 1
        traj.info = dict(traj.info, rollout_actor=a.index, rollout_incarnation=a.incarnation)
        failed = bool(traj.info.get("failed"))
        self.counters["env_errors"] += int(failed)
        if self.admission is not None:  # the rollout ended (as the thread worker reports it)
          self.admission.finish(accepted=not failed)
        self._arrived.append((traj, time.monotonic()))

  def _on_lost(self, a: _Actor, restarted: bool = False) -> None:
    """Actor ``a`` died (or came back as a new incarnation): its prompts go out again, first."""
    if a.outstanding:
      self._reissue.extendleft(reversed(list(a.outstanding.items())))
      a.outstanding.clear()
    # its unfinished pull: drain the buckets it had not reported landed (a bucket it pulled
    # after its last reply keeps one drain thread waiting until the publisher closes)
    self._drain(a, a.buckets_done if a.pulling == getattr(a.pull_wref, "version", -2) else 0)
    if not restarted:
      a.failures += 1
      a.retry_at = time.monotonic() + min(0.5 * a.failures, 5.0)
      if a.failures > 60:
        raise RuntimeError(f"rollout actor {a.index} unreachable for {a.failures} calls; "
                           "rollout.ray_max_restarts exhausted?")
    if a.incarnation is not None and (restarted or a.failures == 1):
      a.restarts += 1
    a.incarnation, a.sent_version, a.version, a.first_serve_version = None, -1, -1, -1
    a.layout, a.has_layout, a.pulling, a.buckets_done = None, False, -1, 0
