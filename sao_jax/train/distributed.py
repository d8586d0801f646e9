"""One program from one CPU to many hosts: ``jax.distributed`` set-up, host-local batches
assembled into global arrays, micro-batch planning, and the SAO trainer on a mesh.

Multi-controller model (JAX's own runtime): every process runs this same trainer on the same
config; each feeds only its own rows of the global batch
(``jax.make_array_from_process_local_data``); the jitted steps see global arrays and GSPMD
inserts the collectives; scalar metrics come back replicated on every process; only process 0
writes logs (``main_process_logger``); orbax checkpoints are written and read by all processes
together (``sao_jax.train.checkpoint.Checkpointer`` on sharded states).
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from sao_jax import algo
from sao_jax.rollout.trajectory import Trajectory, collate
from sao_jax.train import sharding, steps
from sao_jax.train.sao import SAOConfig, make_optimizers

_ENV = {"coordinator_address": "JAX_COORDINATOR_ADDRESS", "num_processes": "JAX_NUM_PROCESSES",
        "process_id": "JAX_PROCESS_ID"}


def initialize(dist_cfg: Optional[Mapping[str, Any]] = None) -> bool:
  """Starts ``jax.distributed`` from a config mapping and/or the environment.

  Fields (config first, then env ``JAX_COORDINATOR_ADDRESS`` / ``JAX_NUM_PROCESSES`` /
  ``JAX_PROCESS_ID``): ``coordinator_address`` ("host:port"; empty = single process, nothing
  is started), ``num_processes``, ``process_id``, ``cpu_collectives`` ("gloo" so CPU
  processes can all-reduce; ignored on GPU/TPU). Must run before any other JAX call.

  Returns True if ``jax.distributed.initialize`` was called. Raises ValueError if an address
  is given without ``num_processes`` / ``process_id``.
  """
  cfg = dict(dist_cfg or {})
  get = lambda k: cfg.get(k) if cfg.get(k) not in (None, "", -1) else os.environ.get(_ENV[k])
  address = get("coordinator_address")
  if not address:
    return False
  num, pid = get("num_processes"), get("process_id")
  if num is None or pid is None:
    raise ValueError("distributed.coordinator_address is set, so distributed.num_processes and "
                     "distributed.process_id are needed too (or JAX_NUM_PROCESSES / "
                     "JAX_PROCESS_ID).")
  collectives = cfg.get("cpu_collectives", "gloo")
  if collectives:
    jax.config.update("jax_cpu_collectives_implementation", collectives)
  jax.distributed.initialize(coordinator_address=address, num_processes=int(num),
                             process_id=int(pid))
  return True


def is_main_process() -> bool:
  """True on process 0 (the one that writes logs and summaries)."""
  return jax.process_index() == 0


class NullLogger:
  """Stands in for ``MetricLogger`` on processes other than 0: accepts and drops everything."""

  def log(self, *args, **kwargs) -> None:
    del args, kwargs

  def close(self) -> None:
    return None


def main_process_logger(run_dir: str, **kwargs):
  """``MetricLogger(run_dir, **kwargs)`` on process 0, a ``NullLogger`` elsewhere."""
  if not is_main_process():
    return NullLogger()
  from sao_jax.train.metrics import MetricLogger  # pylint: disable=import-outside-toplevel
  return MetricLogger(run_dir, **kwargs)


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


def pad_rows(batch: Mapping[str, np.ndarray], rows: int, pad_id: int) -> dict[str, np.ndarray]:
  """Appends empty rows (``tokens = pad_id``, masks/rewards/log-probs 0, ``policy_version`` -1)
  until every array has ``rows`` rows. Raises ValueError if the batch already has more."""
  b = len(batch["tokens"])
  if b > rows:
    raise ValueError(f"batch has {b} rows, more than the planned {rows}.")
  fill = {"tokens": pad_id, "policy_version": -1}
  return {k: np.concatenate([v, np.full((rows - b,) + v.shape[1:], fill.get(k, 0), v.dtype)])
          for k, v in batch.items()}


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


def global_batch(local: Mapping[str, np.ndarray], batch_sharding: NamedSharding,
                 rows: int) -> dict[str, jax.Array]:
  """Assembles each process's rows (``process_rows``) into global jax Arrays of ``rows`` rows.
  On one process this is a sharded ``device_put`` of the whole batch."""
  out = {}
  for k, v in local.items():
    global_shape = (rows,) + tuple(v.shape[1:])
    out[k] = jax.make_array_from_process_local_data(batch_sharding, np.asarray(v), global_shape)
  return out


def put_global(tree: Any, shardings: Any) -> Any:
  """Host pytree (the same values on every process) -> global arrays with ``shardings``.

  Works on one and on many processes (each device's shard is cut from the host copy)."""
  return jax.tree.map(
      lambda x, s: jax.make_array_from_callback(np.shape(x), s,
                                                lambda i, x=x: np.asarray(x)[i]),
      tree, shardings)


class ShardedSAOTrainer:
  """SAO policy steps (SAO §3, Algorithm 1) with params, optimizer states and batches sharded on
  a mesh; the same program on one device, many devices or many processes.

  Per step: values and advantages (skip-observation GAE) from the critic, K critic updates on
  the fixed returns (attention frozen), one DIS policy update -- the same update as
  ``SAOTrainer.step`` -- through ``steps.make_*`` with explicit shardings and gradient
  accumulation over ``microbatches``.

  Args:
    cfg: ``SAOConfig`` (``batch_length`` must be > 0: one compiled shape).
    policy_graphdef / policy_params, critic_graphdef / critic_params: host pure-dict params,
      identical on every process.
    pad_id: padding token id.
    mesh: ``jax.sharding.Mesh`` (``sharding.make_mesh``).
    batch_size: trajectories per global step (the paper's 128).
    tokens_per_device: per-device padded-token budget of one micro-batch (0 = no limit).
    rules / param_axes: logical-axis rules (``sharding.LOGICAL_RULES`` / ``PARAM_AXES``).

  Raises ValueError if ``cfg.batch_length`` is 0.
  """

  def __init__(self, cfg: SAOConfig, policy_graphdef, policy_params, critic_graphdef,
               critic_params, pad_id: int, mesh, *, batch_size: int, tokens_per_device: int = 0,
               rules=sharding.LOGICAL_RULES, param_axes=sharding.PARAM_AXES):
    if cfg.batch_length <= 0:
      raise ValueError("the sharded trainer needs a fixed train.batch_length (> 0) so steps "
                       "compile once; set it to model.max_seq_len.")
    self.spec = cfg.spec
    if (self.spec.objective, self.spec.estimator, self.spec.group_size) != ("dis", "skip_obs_gae", 1):
      raise ValueError(
          f"the sharded trainer (mesh.shape set) runs SAO: objective 'dis' with "
          f"'skip_obs_gae' advantages, one rollout per prompt; train.mode={self.spec.mode!r} "
          f"resolves to objective {self.spec.objective!r} / {self.spec.estimator!r} / "
          f"group_size {self.spec.group_size}. Run that mode on one device (mesh.shape='').")
    self.cfg, self.pad_id, self.mesh = cfg, pad_id, mesh
    self.batch_size = batch_size
    self.rows, self.microbatches = microbatch_plan(
        batch_size, cfg.batch_length, tokens_per_device, sharding.batch_shards(mesh, rules))
    if self.rows % jax.process_count() or batch_size % jax.process_count():
      raise ValueError(f"{self.rows} batch rows do not split over {jax.process_count()} "
                       "processes; change train.batch_size or the mesh.")
    self.policy_tx, self.critic_tx = make_optimizers(cfg, policy_params, critic_params)
    self.policy_sh = sharding.make_step_shardings(mesh, policy_params, self.policy_tx,
                                                  rules=rules, param_axes=param_axes)
    self.critic_sh = sharding.make_step_shardings(mesh, critic_params, self.critic_tx,
                                                  rules=rules, param_axes=param_axes)
    self.policy = self._init_state(policy_params, self.policy_tx, self.policy_sh)
    self.critic = self._init_state(critic_params, self.critic_tx, self.critic_sh)
    self._adv = steps.make_advantage_fn(critic_graphdef, gamma=cfg.gamma,
                                        lam_policy=cfg.lam_policy, lam_critic=cfg.lam_critic,
                                        lam_alpha=cfg.lam_alpha, shardings=self.critic_sh)
    self._critic_step = steps.make_critic_step(critic_graphdef, self.critic_tx,
                                               shardings=self.critic_sh,
                                               microbatches=self.microbatches)
    self._policy_step = steps.make_policy_step(policy_graphdef, self.policy_tx,
                                               eps_low=cfg.eps_low, eps_high=cfg.eps_high,
                                               temperature=cfg.temperature,
                                               shardings=self.policy_sh,
                                               microbatches=self.microbatches)
    self._metrics = jax.jit(_batch_metrics, out_shardings=NamedSharding(mesh, P()))

  @staticmethod
  def _init_state(params, tx, sh):
    params = put_global(params, sh.params)
    create = jax.jit(lambda p: steps.TrainState.create(p, tx), in_shardings=(sh.params,),
                     out_shardings=sh.state)
    return create(params)

  @property
  def batch_sharding(self) -> NamedSharding:
    return self.policy_sh.batch

  def local_rows(self) -> np.ndarray:
    """Global row indices of the padded batch that this process feeds."""
    return process_rows(self.batch_sharding, self.rows)

  def batch(self, local_trajectories: Sequence[Trajectory]) -> dict[str, jax.Array]:
    """This process's trajectories -> its rows (padded with empty rows) -> global arrays.

    Each process must pass ``len(self.local_rows())`` or fewer trajectories."""
    n_local = len(self.local_rows())
    local = collate(local_trajectories, self.pad_id, length=self.cfg.batch_length)
    return self.global_batch(pad_rows(local, n_local, self.pad_id))

  def global_batch(self, local: Mapping[str, np.ndarray]) -> dict[str, jax.Array]:
    """This process's already collated rows (``len(self.local_rows())`` of them) -> global."""
    n_local = len(self.local_rows())
    if len(local["tokens"]) != n_local:
      raise ValueError(f"process {jax.process_index()} fed {len(local['tokens'])} rows; it owns "
                       f"{n_local} of the {self.rows}-row global batch (pad with pad_rows).")
    return global_batch(local, self.batch_sharding, self.rows)

  def step_on_batch(self, batch: dict[str, jax.Array], policy_version: int) -> dict[str, float]:
    """One SAO policy step on a global batch; returns float metrics (same on every process)."""
    batch = dict(batch)
    batch.update(self._adv(self.critic.params, batch))
    critic_metrics = {}
    for _ in range(self.cfg.critic_updates_per_step):
      self.critic, critic_metrics = self._critic_step(self.critic, batch)
    self.policy, policy_metrics = self._policy_step(self.policy, batch)
    extra = self._metrics(batch, jnp.int32(policy_version))
    return {k: float(v) for k, v in {**critic_metrics, **policy_metrics, **extra}.items()}

  def step(self, local_trajectories: Sequence[Trajectory], policy_version: int) -> dict:
    """One SAO policy step on this process's trajectories (all processes call it together)."""
    return self.step_on_batch(self.batch(local_trajectories), policy_version)

  @property
  def local_batch_size(self) -> int:
    """Trajectories each process contributes to one step (``batch_size / process_count``)."""
    return self.batch_size // jax.process_count()

  def critic_only_step(self, local_trajectories: Sequence[Trajectory]) -> dict:
    """Critic warm-up: K value updates on this step's rollouts, no policy update."""
    batch = self.batch(local_trajectories)
    batch.update(self._adv(self.critic.params, batch))
    metrics = {}
    for _ in range(self.cfg.critic_updates_per_step):
      self.critic, metrics = self._critic_step(self.critic, batch)
    metrics = dict(metrics, explained_variance=self._metrics(batch, jnp.int32(0))[
        "explained_variance"])
    return {k: float(v) for k, v in metrics.items()}

  def policy_params_copy(self):
    """The full policy params on this process's default device (for the rollout engine and
    evaluation): gathered from every process's shards."""
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
    host = multihost_utils.process_allgather(self.policy.params, tiled=True)
    return jax.tree.map(jnp.asarray, host)

  def compilations(self) -> dict[str, int]:
    """Compiled executables held by each jitted step (1 each once warm: no recompiles)."""
    fns = {"advantages": self._adv, "critic_step": self._critic_step,
           "policy_step": self._policy_step, "metrics": self._metrics}
    return {k: f._cache_size() for k, f in fns.items()}  # pylint: disable=protected-access


def _batch_metrics(batch, policy_version):
  """Explained variance, staleness and advantage stats over the global batch's action tokens."""
  mask = batch["action_mask"] > 0
  n = jnp.maximum(mask.sum(), 1)
  stale = jnp.where(mask, policy_version - batch["policy_version"], 0).astype(jnp.float32)
  adv = jnp.where(mask, batch["advantages"], 0.0)
  adv_mean = adv.sum() / n
  return {
      "explained_variance": algo.explained_variance(batch["values"], batch["returns"],
                                                    batch["action_mask"]),
      "staleness_mean": stale.sum() / n,
      "staleness_max": jnp.max(stale),
      "advantage_mean": adv_mean,
      "advantage_std": jnp.sqrt(jnp.where(mask, (adv - adv_mean) ** 2, 0.0).sum() / n),
      "action_tokens": mask.sum().astype(jnp.float32),
  }


def make_trainer(mesh_cfg, sao_cfg: SAOConfig, policy_graphdef, policy_params, critic_graphdef,
                 critic_params, pad_id: int, batch_size: int):
  """The trainer the config asks for: ``SAOTrainer`` when ``mesh.shape`` is empty (one device,
  unchanged behaviour), else a ``ShardedSAOTrainer`` on ``make_mesh(parse_mesh_shape(...))``
  with ``mesh.tokens_per_device`` as the micro-batch budget."""
  shape = parse_mesh_shape((mesh_cfg or {}).get("shape", "") or "")
  if not shape:
    from sao_jax.train.sao import SAOTrainer  # pylint: disable=import-outside-toplevel
    return SAOTrainer(sao_cfg, policy_graphdef, policy_params, critic_graphdef, critic_params,
                      pad_id=pad_id)
  return ShardedSAOTrainer(sao_cfg, policy_graphdef, policy_params, critic_graphdef,
                           critic_params, pad_id, sharding.make_mesh(shape),
                           batch_size=batch_size,
                           tokens_per_device=int((mesh_cfg or {}).get("tokens_per_device", 0)))
