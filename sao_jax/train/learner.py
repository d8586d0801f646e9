"""The one learner: every mode, objective and estimator, on any mesh (no mesh = one device).

Per policy step (SAO §3, Algorithm 1), on a ``Batch``:
  1. targets: values V from the current critic, advantages with the estimator
     (``algo.ESTIMATORS``; skip-observation GAE with the length-adaptive policy lambda by
     default) and returns with ``lam_critic`` -- from the same values; critic-free estimators
     (GRPO, running mean) give per-row advantages instead;
  2. K critic updates (attention frozen, and left out of the differentiated set) on those
     fixed returns; step 1 and the first update share one critic forward;
  3. one policy update with the objective (``algo.OBJECTIVES``; DIS by default) against the
     engine's rollout log-probs (from the LM head in chunks, at action tokens only;
     ``train.logprob_chunk``) -- or ``train.policy_minibatches`` M updates, one per
     mini-batch, against the policy at the start of the batch (the PPO baselines' setting);
  4. batch metrics (staleness, advantages, explained variance), once, inside jit;
  5. the caller publishes the new weights (``policy_version`` + 1).

Multi-controller model (JAX's own runtime): every process runs the same learner on the same
config and feeds only its own rows (``jax.make_array_from_process_local_data``); the jitted
steps see global arrays and GSPMD inserts the collectives. The jits below are the place to read
what is sharded how and what is donated.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P

from sao_jax import algo, roles
from sao_jax.rollout import placement
from sao_jax.rollout.trajectory import Trajectory
from sao_jax.train import modes, optim, sharding, steps
from sao_jax.train.baselines import RunningMeanBaseline
from sao_jax.train.batch import Batch, build_batch, require_trajectories
from sao_jax.train.distributed import microbatch_plan, process_rows


GRPO_EPS = 1e-6  # the GRPO estimator's std floor (not a config field)


@dataclasses.dataclass(frozen=True)
class LearnerConfig:
  """What the learner reads: the ``train`` role (``roles.Train``: every field's default, range
  and doc live there) and four fields of other roles, filled by ``from_run``. Derived once at
  construction from ``train`` (not settable): ``spec``, the resolved ``modes.ModeSpec``
  (objective, estimator, group size, critic); ``objective_kwargs``, the objective's knobs it
  accepts; ``lam_policy`` ('adaptive' or a float); ``critic_frozen_patterns`` (() when
  ``train.freeze_critic_attention`` is off); ``value_bounds`` (floats).

  Raises ValueError (naming the field) on a bad mode, objective or estimator."""
  train: roles.Train
  temperature: float      # rollout.temperature: the engine's sampling temperature
  batch_length: int       # model.max_seq_len: a batch's padded length (bucketed above it)
  tokens_per_device: int  # mesh.tokens_per_device: the micro-batch budget (0 = one pass)
  serving_dtype: str      # model.param_dtype: the dtype ``policy_params`` publishes
  spec: modes.ModeSpec = dataclasses.field(init=False)
  objective_kwargs: dict = dataclasses.field(init=False)
  lam_policy: Any = dataclasses.field(init=False)
  critic_frozen_patterns: tuple = dataclasses.field(init=False)
  value_bounds: tuple = dataclasses.field(init=False)

  def __post_init__(self):
    t = self.train
    spec = modes.resolve(t.mode, t.objective, t.advantage_estimator, t.group_size, t.batch_size)
    knobs = dict(aggregation=t.aggregation, entropy_coef=t.entropy_coef, kl_coef=t.kl_coef,
                 dual_clip=t.dual_clip or None, tis_cap=t.tis_cap, icepop_low=t.icepop_low,
                 icepop_high=t.icepop_high, norm_constant=t.loss_norm_constant or None)
    accepted = inspect.signature(algo.get_objective(spec.objective)).parameters
    derived = dict(
        spec=spec, objective_kwargs={k: v for k, v in knobs.items() if k in accepted},
        lam_policy=t.lam_policy if t.lam_policy == "adaptive" else float(t.lam_policy),
        critic_frozen_patterns=(tuple(t.critic_frozen_patterns)
                                if t.freeze_critic_attention else ()),
        value_bounds=tuple(float(v) for v in t.value_bounds))
    for k, v in derived.items():
      object.__setattr__(self, k, v)

  @classmethod
  def from_run(cls, run: roles.Run, **train) -> "LearnerConfig":
    """From the typed run: ``run.train``, ``rollout.temperature``, ``model.max_seq_len``,
    ``mesh.tokens_per_device`` and ``model.param_dtype``; ``train`` replaces fields of
    ``run.train`` by name (TypeError for a name it does not have)."""
    return cls(train=dataclasses.replace(run.train, **train),
               temperature=run.rollout.temperature, batch_length=run.model.max_seq_len,
               tokens_per_device=run.mesh.tokens_per_device,
               serving_dtype=run.model.param_dtype)

  @property
  def band(self) -> tuple[float, float]:
    """(eps_low, eps_high) of the objective: the DIS band for dis, the clip band otherwise."""
    t = self.train
    if self.spec.objective == "dis":
      return t.eps_low, t.eps_high
    return t.ppo_eps_low, t.ppo_eps_high


BUCKET_ABOVE = 512  # model.max_seq_len above which batches are padded to a length bucket


def one_device_mesh():
  """A mesh of this process's first device (the learner's default)."""
  return sharding.make_mesh({"data": 1}, devices=jax.local_devices()[:1])


def is_abstract(tree) -> bool:
  """True when every leaf of ``tree`` is a ``jax.ShapeDtypeStruct`` (shapes only, no values)."""
  leaves = jax.tree.leaves(tree)
  return bool(leaves) and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)


def _put(tree, shardings):
  """Pytree -> new global arrays with ``shardings``. Always a copy: the learner owns (and
  donates) what it holds, never the caller's arrays. A jax Array is copied device to device
  (each device receives its shard; one already laid out as ``shardings``, e.g. loaded straight
  into the learner's mesh, is copied in place, never through one device or the host); host
  arrays (the same values on every process), and on several processes arrays local to one,
  are sliced per device from the host. An abstract tree (``is_abstract``) gives
  ``ShapeDtypeStruct``s with ``shardings``."""
  if is_abstract(tree):
    return sharding.abstract_like(tree, shardings)
  def put(x, s):
    if isinstance(x, jax.Array) and (jax.process_count() == 1 or not x.is_fully_addressable):
      return jax.device_put(x, s, may_alias=False)
    return jax.make_array_from_callback(np.shape(x), s, lambda i, x=x: np.asarray(x)[i])
  return jax.tree.map(put, tree, shardings)


class Learner:
  """Policy and critic train states on a mesh, and the jitted SAO-family steps.

  Args:
    cfg: ``LearnerConfig``.
    policy_graphdef / policy_params: the policy ``Transformer`` (``nnx.split``; pure dict).
    critic_graphdef / critic_params: the ``Critic``; ignored (may be None) when the estimator
      is critic-free.
    pad_id / vocab_size: padding id and vocabulary bound of ``build_batch``'s checks.
    mesh: a ``jax.sharding.Mesh`` (``sharding.make_mesh``); None = one device.

  The params are copied onto the mesh (the caller's arrays stay valid; the learner's own states
  are donated to its steps) as float32 master weights whatever their dtype (bf16 / f16 are
  upcast; ``optim.master_copy``), with float32 Adam moments: the model computes in its
  ``ModelConfig.dtype`` and ``policy_params`` publishes ``cfg.serving_dtype``. Raises
  ValueError on a bad config (as ``LearnerConfig``) or a freeze pattern that matches no critic
  parameter.
  Abstract params (every leaf a ``jax.ShapeDtypeStruct``) give abstract states
  (``ShapeDtypeStruct`` leaves with the mesh's shardings) and no device memory:
  ``jitted_steps()[i].lower(...)`` then compiles the steps ahead of time (``sao_jax.plan``).
  """

  def __init__(self, cfg: LearnerConfig, policy_graphdef, policy_params, critic_graphdef=None,
               critic_params=None, *, pad_id: int, vocab_size: Optional[int] = None,
               mesh=None):
    self.cfg, self.spec = cfg, cfg.spec
    self.pad_id, self.vocab_size = pad_id, vocab_size
    self.mesh = mesh if mesh is not None else one_device_mesh()
    self.uses_critic = self.spec.uses_critic
    est = algo.get_estimator(self.spec.estimator)
    self._baseline, self.baseline_nonempty_fraction = None, 0.0
    if est.baseline_window:
      per_prompt = est.baseline_window == "prompt"
      self._baseline = RunningMeanBaseline(
          cfg.train.baseline_window if per_prompt else cfg.train.global_baseline_window,
          per_key=per_prompt)
    self.policy_tx = optim.make_optimizer(policy_params, lr=cfg.train.policy_lr,
                                          max_grad_norm=cfg.train.max_grad_norm,
                                          eps=cfg.train.adam_eps)
    self.policy_sh = sharding.make_step_shardings(self.mesh, policy_params, self.policy_tx)
    self.policy = self._init_state(policy_params, self.policy_tx, self.policy_sh)
    self.critic = self.critic_tx = self.critic_sh = None
    if self.uses_critic:
      # the critic's lr warm-up is counted in policy steps (K optimizer updates per step)
      self.critic_tx = optim.make_optimizer(
          critic_params, lr=cfg.train.critic_lr, max_grad_norm=cfg.train.max_grad_norm,
          eps=cfg.train.adam_eps, b1=cfg.train.critic_b1,
          warmup_steps=cfg.train.critic_lr_warmup_steps * cfg.train.critic_updates_per_step,
          frozen_patterns=cfg.critic_frozen_patterns)
      self.critic_sh = sharding.make_step_shardings(self.mesh, critic_params, self.critic_tx)
      self.critic = self._init_state(critic_params, self.critic_tx, self.critic_sh)
    kl = cfg.objective_kwargs.get("kl_coef", 0.0)
    self._ref = _put(policy_params, self.policy_sh.params) if kl else None
    self.batch_sharding = self.policy_sh.batch
    self._graphdefs = (policy_graphdef, critic_graphdef)
    self._shards = sharding.batch_shards(self.mesh)
    self._jitted: dict[int, tuple] = {}

  @staticmethod
  def _init_state(params, tx, sh):
    def create_fn(p):
      return steps.TrainState.create(optim.master_copy(p), tx)
    if is_abstract(params):  # shapes only: the states' shapes with their shardings
      return sharding.abstract_like(jax.eval_shape(create_fn, params), sh.state)
    create = jax.jit(create_fn, in_shardings=(sh.params,), out_shardings=sh.state)
    return create(_put(params, sh.params))

  def _constrain(self, x, kind):
    spec = self.policy_sh.logits_spec if kind == "logits" else self.policy_sh.values_spec
    return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))

  def jitted_steps(self, microbatches: int = 1):
    """The jitted steps for ``microbatches`` micro-batches: (targets, critic, policy, metrics,
    first_critic).

    ``first_critic(critic_state, batch) -> (critic_state, metrics, targets)`` is
    ``steps.targets_and_critic_update``: the targets and the first of the K critic updates from
    one critic forward (None without a critic); ``targets`` serves critic-free estimators.
    The critic differentiates only its trainable leaves (``critic_frozen_patterns``); the
    policy's log-probs come from the LM head in chunks of ``train.logprob_chunk`` tokens per
    device at action tokens only.

    Shardings: params and optimizer states as ``sharding.make_step_shardings`` lays them out
    (the model's logical axes); batch rows along the mesh's ``batch`` axes; metrics replicated.
    The train states are donated (updated in place)."""
    if microbatches in self._jitted:
      return self._jitted[microbatches]
    cfg, (pg, cg) = self.cfg, self._graphdefs
    rep = NamedSharding(self.mesh, P())
    rows = self.batch_sharding
    target_kwargs = dict(estimator=self.spec.estimator, gamma=cfg.train.gamma,
                         lam_policy=cfg.lam_policy, lam_alpha=cfg.train.lam_alpha,
                         lam_critic=cfg.train.lam_critic,
                         bootstrap_truncated=cfg.train.bootstrap_truncated,
                         grpo_eps=GRPO_EPS, value_bounds=cfg.value_bounds,
                         center_advantages=cfg.train.center_advantages)
    targets = jax.jit(
        functools.partial(steps.advantage_targets, cg, **target_kwargs,
                          constrain=self._constrain),
        in_shardings=(self.critic_sh.params if self.critic_sh else None, rows),
        out_shardings=rows)
    critic = first = None
    if self.uses_critic:
      critic_kwargs = dict(value_clip_eps=cfg.train.value_clip_eps, microbatches=microbatches,
                           constrain=self._constrain,
                           frozen_patterns=cfg.critic_frozen_patterns)
      critic = jax.jit(
          functools.partial(steps.critic_update, cg, self.critic_tx, **critic_kwargs),
          in_shardings=(self.critic_sh.state, rows, rows),
          out_shardings=(self.critic_sh.state, rep), donate_argnums=0)
      first = jax.jit(
          functools.partial(steps.targets_and_critic_update, cg, self.critic_tx,
                            target_kwargs=target_kwargs, **critic_kwargs),
          in_shardings=(self.critic_sh.state, rows),
          out_shardings=(self.critic_sh.state, rep, rows), donate_argnums=0)
    eps_low, eps_high = cfg.band
    kwargs = dict(cfg.objective_kwargs)
    if self.spec.objective != "reinforce":
      kwargs.update(eps_low=eps_low, eps_high=eps_high)
    if microbatches > 1 and kwargs.get("aggregation", "token_mean") != "token_mean":
      raise ValueError("micro-batching (mesh.tokens_per_device) is exact only for "
                       "train.aggregation='token_mean'; set mesh.tokens_per_device=0 or use "
                       "token_mean.")
    policy = jax.jit(
        functools.partial(steps.policy_update, pg, self.policy_tx, objective=self.spec.objective,
                          objective_kwargs=kwargs, temperature=cfg.temperature,
                          microbatches=microbatches, minibatches=cfg.train.policy_minibatches,
                          constrain=self._constrain, logprob_chunk=cfg.train.logprob_chunk,
                          row_shards=self._shards),
        in_shardings=(self.policy_sh.state, rows, rows,
                      self.policy_sh.params if self._ref is not None else None),
        out_shardings=(self.policy_sh.state, rep), donate_argnums=0)
    # A fresh partial, as for the other steps: jax shares one compile cache between jits of the
    # same function object, so a bare ``steps.batch_metrics`` would count other learners'
    # compiles in ``compilations()``.
    metrics = jax.jit(functools.partial(steps.batch_metrics), in_shardings=(rows, rows, rep),
                      out_shardings=rep)
    self._jitted[microbatches] = (targets, critic, policy, metrics, first)
    return self._jitted[microbatches]

  # ---- batches -------------------------------------------------------------------------------
  def plan(self, local_trajectories: int, length: int = 0) -> tuple[int, int]:
    """(global rows, micro-batches) for a step on ``local_trajectories`` per process of
    ``length`` tokens (default ``model.max_seq_len``)."""
    return microbatch_plan(local_trajectories * jax.process_count(),
                           length or self.cfg.batch_length or 1, self.cfg.tokens_per_device,
                           self._shards)

  def batch_length_for(self, local_trajectories: Sequence[Trajectory]) -> int:
    """T of a batch: ``model.max_seq_len`` for short contexts (<= ``BUCKET_ABOVE`` tokens: one
    compiled shape) and on several processes (they must agree on it); otherwise the longest
    trajectory rounded up to 32 x a power of two, at most ``model.max_seq_len`` (a few compiled
    shapes, and far fewer padded tokens for long-context configs)."""
    limit = self.cfg.batch_length
    if jax.process_count() > 1 or not limit or limit <= BUCKET_ABOVE:
      return limit
    longest = max((len(t.tokens) for t in local_trajectories), default=1)
    t = 32
    while t < longest:
      t *= 2
    return min(t, limit) if longest <= limit else limit  # longer: build_batch names it

  def batch(self, local_trajectories: Sequence[Trajectory]) -> tuple[Batch, int]:
    """This process's trajectories -> (global ``Batch`` on the mesh, micro-batches).

    Rows are padded with empty rows to the planned row count; the running-mean baseline (if
    the estimator keeps one) is scored here, before the rewards join its window, and
    ``baseline_nonempty_fraction`` is the share of these trajectories whose window held at
    least one earlier reward (``train_step`` reports it). Raises
    ``BatchError`` naming the trajectory and field of a malformed trajectory, "no
    trajectories" for none, an incomplete group in a grpo mode naming train.group_size."""
    require_trajectories(local_trajectories)
    length = self.batch_length_for(local_trajectories)
    rows, micro = self.plan(len(local_trajectories), length)
    n_local = len(process_rows(self.batch_sharding, rows))
    baseline = None
    if self._baseline is not None:
      baseline, nonempty = self._baseline([t.problem_id for t in local_trajectories],
                                          [t.reward for t in local_trajectories])
      self.baseline_nonempty_fraction = float(np.mean(nonempty)) if len(nonempty) else 0.0
    host = build_batch(local_trajectories, self.pad_id, length=length,
                       rows=n_local, vocab_size=self.vocab_size, baseline=baseline,
                       group_size=self.spec.group_size)
    return self.global_batch(host, rows), micro

  def global_batch(self, host: Batch, rows: int) -> Batch:
    """This process's rows of a host ``Batch`` -> global arrays of ``rows`` rows."""
    return jax.tree.map(
        lambda v: jax.make_array_from_process_local_data(
            self.batch_sharding, np.asarray(v), (rows,) + tuple(np.shape(v)[1:])), host)

  # ---- steps ---------------------------------------------------------------------------------
  def step(self, batch: Batch, policy_version: int, microbatches: int = 1) -> dict:
    """One policy step of the configured mode: targets, K critic updates, one policy update.

    The targets come from the critic before its updates, in the same jitted call as the first
    update (one forward for both); the other K - 1 updates use the same fixed targets.
    Returns float metrics (the same on every process; the critic's from its last update) and
    ``staleness_hist`` (list of int: entry s = action tokens with staleness s against
    ``policy_version``)."""
    _, _, policy_fn, metrics_fn, _ = self.jitted_steps(microbatches)
    targets, out = self._targets_and_critic_updates(batch, microbatches)
    self.policy, policy_metrics = policy_fn(self.policy, batch, targets["advantages"], self._ref)
    out = {**out, **policy_metrics, **metrics_fn(batch, targets, jnp.int32(policy_version))}
    return _to_host(out, self.uses_critic)

  def _targets_and_critic_updates(self, batch: Batch, microbatches: int):
    """(targets, metrics of the last critic update): K critic updates on targets from the
    critic before them (no updates, {} metrics, without a critic)."""
    targets_fn, critic_fn, _, _, first_fn = self.jitted_steps(microbatches)
    if not self.uses_critic or self.cfg.train.critic_updates_per_step < 1:
      return targets_fn(self.critic.params if self.uses_critic else None, batch), {}
    self.critic, out, targets = first_fn(self.critic, batch)
    for _ in range(self.cfg.train.critic_updates_per_step - 1):
      self.critic, out = critic_fn(self.critic, batch, targets)
    return targets, out

  def critic_only_step(self, batch: Batch, microbatches: int = 1) -> dict:
    """Value pre-training: K critic updates on rollouts of the current policy, no policy
    update. Returns {} for a critic-free estimator."""
    if not self.uses_critic:
      return {}
    metrics_fn = self.jitted_steps(microbatches)[3]
    targets, out = self._targets_and_critic_updates(batch, microbatches)
    m = metrics_fn(batch, targets, jnp.int32(0))
    out = {**out, **{k: m[k] for k in ("explained_variance", "value_min", "value_max")}}
    return _to_host(out, True)

  def train_step(self, local_trajectories: Sequence[Trajectory], policy_version: int) -> dict:
    """``batch`` + ``step`` in one call (plus ``baseline_nonempty_fraction`` with a
    running-mean estimator)."""
    batch, micro = self.batch(local_trajectories)
    out = self.step(batch, policy_version, micro)
    if self._baseline is not None:
      out["baseline_nonempty_fraction"] = self.baseline_nonempty_fraction
    return out

  # ---- weights and checkpoints ---------------------------------------------------------------
  def policy_params(self, shardings=None):
    """The policy params in ``cfg.serving_dtype`` (``model.param_dtype``) laid out as
    ``shardings`` (the rollout engine's: ``placement.serving_shardings``; default this process's
    first device), for the engine and evaluation: a publish. The float32 master is cast on the
    learner's mesh, then each target device receives the pieces of the cast shards that make
    up its block, device to device (``placement.reshard``: no host copy, no whole array on a
    device that does not hold one in the target layout). A copy: the learner's steps donate
    its own arrays. Over several processes with no ``shardings`` every process gathers the
    whole tree (``process_allgather``, the Ray actors' weight sync)."""
    params = _cast_floating(self.policy.params, jnp.dtype(self.cfg.serving_dtype))
    if shardings is None and jax.process_count() > 1:
      params = multihost_utils.process_allgather(params, tiled=True)
      return jax.device_put(params, jax.local_devices()[0], may_alias=False)
    return placement.reshard(params, shardings if shardings is not None
                             else placement.serving_shardings(params, None))

  def states(self) -> dict:
    """{"policy": TrainState, "critic": TrainState or None} (what a checkpoint holds)."""
    return {"policy": self.policy, "critic": self.critic}

  def restore_target(self) -> dict:
    """Abstract states with this mesh's shardings: an orbax restore target that lays a
    checkpoint from any mesh out on this one."""
    out = {"policy": sharding.abstract_like(self.policy, self.policy_sh.state)}
    if self.uses_critic:
      out["critic"] = sharding.abstract_like(self.critic, self.critic_sh.state)
    return out

  def load_states(self, states: dict) -> None:
    """Adopts restored states (from ``restore_target``)."""
    self.policy = states["policy"]
    if self.uses_critic:
      self.critic = states["critic"]

  def compilations(self) -> dict[str, int]:
    """Compiled executables per jitted step that ran (1 each once warm: no recompiles)."""
    names = ("targets", "critic", "policy", "metrics", "first_critic")
    out: dict[str, int] = {}
    for fns in self._jitted.values():
      for n, f in zip(names, fns):
        size = f._cache_size() if f is not None else 0  # pylint: disable=protected-access
        if size:
          out[n] = out.get(n, 0) + size
    return out


@functools.partial(jax.jit, static_argnums=1)
def _cast_floating(tree, dtype):
  return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                      tree)


def _to_host(metrics: dict, uses_critic: bool) -> dict:
  out = {}
  for k, v in metrics.items():
    if k == "staleness_hist":
      h = np.asarray(v).tolist()
      while h and h[-1] == 0:
        h.pop()
      out[k] = h
    else:
      out[k] = float(v)
  if not uses_critic:
    for k in ("explained_variance", "value_min", "value_max"):
      out.pop(k, None)
  return out
