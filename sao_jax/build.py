"""The composition root: every object a run is made of, built from the typed roles
(``sao_jax/roles.py``), in one place.

What it builds, and from which role:
  * ``build_policy``: the starting ``Policy`` (``run.model``: checkpoint / GGUF / random init;
    ``run.sft``: the warm start) -- ``sft_key`` names a cached warm start;
  * ``critic_from_policy``: the critic, a copy of the policy's backbone with a zero value head;
  * ``make_meshes``: the learner's mesh (``run.mesh``) and the rollout engine's
    (``rollout.devices`` / ``rollout.mesh``), a split of the local devices
    (``rollout/placement.py``); ``make_learner`` (``run.train``, via ``LearnerConfig``);
  * ``make_engine``: a JetStream-API ``SAOEngine`` (``run.rollout``);
  * ``rollout_env`` and ``worker_kwargs``: the guarded environment and the rollout worker's
    settings, the same for the thread source and the Ray rollout actor;
  * ``make_source``: the ``TrajectorySource`` of ``run.rollout.backend``;
  * ``evaluate``: greedy evaluation (``run.eval``).

The driver (``train/loop.py``), the Ray rollout actor, ``eval.py`` and the benchmarks call these;
none of them builds these objects its own way. Only the top (``main.py``, ``loop.run``,
``eval.main``) sees the ml_collections ConfigDict.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sao_jax import faults, pretrained, roles
from sao_jax.envs.guard import GuardedEnv
from sao_jax.models.transformer import Critic, ModelConfig, Transformer
from sao_jax.rollout.engine import SAOEngine
from sao_jax.rollout import placement
from sao_jax.rollout.ledger import PromptLedger
from sao_jax.rollout.source import ThreadSource
from sao_jax.rollout.worker import env_workers_for, generate_trajectories
from sao_jax.train import distributed, sharding
from sao_jax.train import sft as sft_lib
from sao_jax.train.checkpoint import load_policy_params
from sao_jax.train.learner import Learner, LearnerConfig
from sao_jax.train.progress import Progress


@dataclasses.dataclass
class Policy:
  """The starting policy: model config, graphdef (static), params (pure dict), its source and
  whether it was loaded from a checkpoint."""
  mcfg: ModelConfig
  graphdef: Any
  params: Any
  source: str
  loaded: bool = False


def graphdef_of(mcfg: ModelConfig):
  """The ``Transformer`` graphdef of ``mcfg`` (abstract: no parameter is initialised)."""
  return nnx.split(nnx.eval_shape(lambda: Transformer(mcfg, rngs=nnx.Rngs(0))))[0]


def _set_fields(obj, skip: tuple = ()) -> dict:
  """The fields of dataclass ``obj`` whose value differs from the field's default (``skip``
  left out): a field added later with a default leaves every earlier identity unchanged."""
  out = {}
  for f in dataclasses.fields(obj):
    if f.name in skip:
      continue
    v = getattr(obj, f.name)
    if f.default is not dataclasses.MISSING:
      default = f.default
    elif f.default_factory is not dataclasses.MISSING:
      default = f.default_factory()
    else:
      default = dataclasses.MISSING
    if default is dataclasses.MISSING or v != default:
      out[f.name] = dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v
  return out


def sft_key(run: roles.Run, mcfg) -> str:
  """The identity of a warm start (its ``sft.cache_dir`` file name): the ``sft`` and ``task``
  fields set away from their defaults, the model and the seed -- not where it is cached
  (``sft.cache_dir``), nor ``task.prompt_pool`` (which prompts RL cycles over), nor the tool
  latency (``task.tool_latency_*``: it delays training rollouts, the demonstrations are the same);
  a field added to ``roles.Sft`` / ``roles.Task`` with a default does not change existing
  identities."""
  return sft_lib.cache_key(
      _set_fields(run.sft, ("cache_dir",)),
      _set_fields(run.task, ("prompt_pool", "tool_latency_median_s", "tool_latency_sigma")),
      str(mcfg), run.seed)


def build_policy(run: roles.Run, task, warm_start: bool = True, mesh=None) -> Policy:
  """The policy from ``model.checkpoint_dir`` / ``model.gguf`` (Hugging Face folder, GGUF, or a
  sao_jax run checkpoint), else a random init of ``run.model`` warm-started by SFT on the
  task's demonstrations (``sft.*``; cached under ``sft.cache_dir``) when ``warm_start``.
  ``mesh`` (the learner's, ``make_mesh``): a Hugging Face / GGUF checkpoint is loaded straight
  into its shardings there (``pretrained.load_model``); None = one device."""
  model, sft = run.model, run.sft
  loaded = pretrained.load_model(model, mesh)  # HF checkpoint folder / GGUF, else None
  if loaded:
    mcfg, params = loaded
    return Policy(mcfg, graphdef_of(mcfg), params, f"{pretrained.source(model)} checkpoint", True)
  mcfg = pretrained.model_config(model, task.tokenizer.vocab_size)
  graphdef, params = nnx.split(Transformer(mcfg, rngs=nnx.Rngs(run.seed)))
  params = nnx.to_pure_dict(params)
  if model.checkpoint_dir:
    return Policy(mcfg, graphdef, load_policy_params(model.checkpoint_dir, params),
                  model.checkpoint_dir, True)
  if not (task.sft_demos and sft.steps > 0 and warm_start):
    return Policy(mcfg, graphdef, params, "random init")
  t0 = time.time()
  bar = Progress(sft.steps, desc="SFT warm-up", mode=run.log.progress)
  params, loss = sft_lib.cached_sft(
      sft.cache_dir, sft_key(run, mcfg),
      params, lambda: sft_lib.train_sft(
          graphdef, params, task.sft_demos, pad_id=task.tokenizer.pad_id,
          steps_=sft.steps, batch_size=sft.batch_size, lr=sft.lr,
          seed=run.seed, log_every=max(1, sft.steps // 5),
          log=lambda msg: print(msg, file=bar.stream, flush=True), on_step=lambda i: bar.update()))
  bar.close()
  done = (f"loaded from the cache {sft.cache_dir}" if np.isnan(loss) else
          f"final loss {loss:.4f}")  # a cached warm start has no loss to report
  print(f"sft warm-up: {sft.steps} steps, {done}, {time.time() - t0:.1f}s", flush=True)
  return Policy(mcfg, graphdef, params, "SFT warm start")


def critic_from_policy(mcfg: ModelConfig, policy_params, seed: int):
  """A critic whose backbone starts as a copy of the policy and whose value head is zero.

  The backbone is built in place: each policy array is copied with its own sharding (device to
  device, no gather; host arrays stay on the host), and no critic backbone is initialised."""
  del seed  # the only initialised part, the value head, is zeros
  graphdef, params = nnx.split(nnx.eval_shape(lambda: Critic(mcfg, rngs=nnx.Rngs(0))))
  params = nnx.to_pure_dict(params)
  params["value_head"] = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                                      params["value_head"])
  params["backbone"] = jax.tree.map(
      lambda x: (jax.device_put(x, x.sharding, may_alias=False) if isinstance(x, jax.Array)
                 else np.array(x)), policy_params)
  return graphdef, params


def make_mesh(mesh: roles.Mesh, devices=None) -> Optional[jax.sharding.Mesh]:
  """The mesh of ``mesh.shape`` ("fsdp=-1", "fsdp=2,tensor=2,expert=2", ...) over ``devices``
  (default every device); None when the shape is empty (the learner then uses one device: the
  first of ``devices``, else this process's first)."""
  shape = distributed.parse_mesh_shape(mesh.shape)
  if shape:
    return sharding.make_mesh(shape, devices=devices)
  return None if devices is None else sharding.make_mesh({"data": 1}, devices=list(devices)[:1])


def make_meshes(run: roles.Run, devices=None
                ) -> tuple[Optional[jax.sharding.Mesh], Optional[jax.sharding.Mesh]]:
  """(the learner's mesh, the rollout engine's mesh) of ``run.mesh`` and ``run.rollout`` over
  ``devices`` (default this process's local devices; ``plan.py`` passes a TPU slice's).

  ``rollout.devices`` N > 0 splits the devices (``placement.split_devices``): the engine
  gets the first N laid out as ``rollout.mesh`` (axes data / tensor / expert), the learner the
  rest laid out as ``mesh.shape``. N = 0: the learner's mesh over every device and no rollout
  mesh (the engine on device 0). Raises ValueError naming the field (``validate_config`` reports
  the same before anything is built)."""
  n = run.rollout.devices
  if not n:
    return make_mesh(run.mesh, devices), None
  if devices is None and jax.process_count() > 1:
    raise ValueError(f"rollout.devices={n} splits one process's devices; a multi-process job's "
                     "rollout runs on Ray actors; fix: set rollout.devices=0")
  rollout_devices, train_devices = placement.split_devices(
      jax.local_devices() if devices is None else devices, n)
  return (make_mesh(run.mesh, train_devices),
          placement.rollout_mesh(run.rollout.mesh, rollout_devices))


def make_learner(run: roles.Run, policy: Policy, pad_id: int, mesh=None) -> Learner:
  """The learner for ``run.train`` on ``mesh`` (default ``make_mesh(run.mesh)``), with a critic
  initialised from the policy when the estimator needs one. Params already sharded on that mesh
  (``build_policy(..., mesh=)``) are copied device to device, never through one device."""
  cfg = LearnerConfig.from_run(run)
  critic = (critic_from_policy(policy.mcfg, policy.params, run.seed + 1)
            if cfg.spec.uses_critic else (None, None))
  return Learner(cfg, policy.graphdef, policy.params, *critic, pad_id=pad_id,
                 vocab_size=policy.mcfg.vocab_size,
                 mesh=mesh if mesh is not None else make_mesh(run.mesh))


def make_engine(run: roles.Run, mcfg: ModelConfig, graphdef, tokenizer, *, slots: int,
                temperature: float, seed: Optional[int] = None, mesh=None) -> SAOEngine:
  """A JetStream-API ``SAOEngine`` over ``graphdef`` (``Policy.graphdef`` or ``graphdef_of``):
  ``slots`` decode slots, prompts up to ``rollout.max_prefill_length``, the compile buckets of
  ``rollout.kv_bucket`` / ``rollout.prefill_rows``, sampling at
  ``temperature`` (0 = greedy) from ``seed`` (default ``run.seed``); ``mesh``: the engine's own
  (slots over ``data``; None = one device)."""
  return SAOEngine(mcfg, graphdef, tokenizer, max_concurrent_decodes=slots,
                   max_prefill_length=run.rollout.max_prefill_length,
                   temperature=temperature, seed=run.seed if seed is None else seed, mesh=mesh,
                   kv_bucket=run.rollout.kv_bucket, prefill_rows=run.rollout.prefill_rows)


def env_fault_rate() -> float:
  """The injected env.step failure rate of a fault-injection run (``SAO_FAULT_ENV_RATE``, a
  probability in [0, 1]; 0 when unset): ``sao_jax/faults.py``'s environment switch."""
  return float(os.environ.get("SAO_FAULT_ENV_RATE", "0"))


def rollout_env(run: roles.Run, env, seed: int) -> tuple[GuardedEnv, int]:
  """(``GuardedEnv`` around the task's ``env``, its env threads): ``rollout.env_timeout_s``,
  the fault rate, ``rollout.env_workers`` resolved (``env_workers_for``)."""
  workers = env_workers_for(run)  # >0: env.step off the decode loop (slow tool calls)
  return GuardedEnv(env, timeout_s=run.rollout.env_timeout_s, fault_rate=env_fault_rate(),
                    seed=seed, max_workers=max(4, workers)), workers


def worker_kwargs(run: roles.Run) -> dict:
  """The ``RolloutWorker`` settings from ``run.rollout`` / ``run.model`` (both rollout paths)."""
  r = run.rollout
  return dict(max_new_tokens=r.max_new_tokens, max_seq_len=run.model.max_seq_len,
              temperature=r.temperature, kv_on_update=r.kv_on_update,
              decode_steps=r.decode_steps, overlap_host=r.overlap_host)


def make_source(run: roles.Run, task, policy: Policy, params, version: int, ledger: PromptLedger,
                spec, *, start_step: int = 0, run_dir: str = "", mesh=None):
  """The trajectory source of ``rollout.backend`` ("thread": a rollout worker thread in this
  process, its engine on ``mesh``, the rollout mesh of ``make_meshes``; "ray":
  ``rollout.num_workers`` Ray rollout actors) with the mode's groups / barrier (``spec``), the
  staleness policy and the ledger. ``params``: laid out for the engine
  (``Learner.policy_params(placement.serving_shardings(...))``)."""
  r = run.rollout
  common = dict(group_size=spec.group_size, synchronous=spec.synchronous,
                batch_size=run.train.batch_size, staleness_policy=r.staleness_policy,
                max_staleness=r.max_staleness, run_dir=run_dir)
  if r.backend == "ray":  # N rollout actors (rollout/ray_source.py); ray is heavy and optional
    from sao_jax.rollout.ray_source import RaySource  # pylint: disable=import-outside-toplevel
    return RaySource(run, policy.mcfg, ledger, params, version, **common)
  engine = make_engine(run, policy.mcfg, policy.graphdef, task.tokenizer, slots=r.slots,
                       temperature=r.temperature, mesh=mesh)
  seed = faults.step_seed(run.seed, start_step) if start_step else run.seed
  engine.reseed(seed)
  env, env_workers = rollout_env(run, task.env, run.seed)
  return ThreadSource(
      engine, env, ledger, params, version, stop_ids=task.stop_ids, queue_size=r.queue_size,
      env_workers=env_workers, seed=seed, lockstep=r.lockstep, lockstep_delay=r.lockstep_delay,
      stop_strings=task.stop_strings, **worker_kwargs(run), **common)


def evaluate(engine, task, params, problems, run: roles.Run, version: int = 0) -> dict:
  """Greedy pass@1 on ``problems`` through the engine; also tool-use rate, mean length and
  ``formatted``: the fraction whose response has a non-empty final answer (``info["answer"]``,
  the last ``\\boxed{}`` of the math tasks; NaN for a task that reports none), so
  accuracy / formatted is the accuracy given the format."""
  env = task.eval_env if getattr(task, "eval_env", None) is not None else task.env
  trajs = generate_trajectories(engine, env, params, problems, stop_ids=task.stop_ids,
                                max_new_tokens=run.rollout.max_new_tokens,
                                max_seq_len=run.model.max_seq_len, temperature=0.0,
                                version=version, stop_strings=task.stop_strings,
                                env_workers=env_workers_for(run),
                                decode_steps=run.rollout.decode_steps)
  rewards = np.array([t.reward for t in trajs], np.float64)
  answers = [t.info["answer"] for t in trajs if "answer" in t.info]
  formatted = (float(np.mean([bool(a) for a in answers])) if answers and len(answers) == len(trajs)
               else float("nan"))
  return {"accuracy": float(rewards.mean()) if rewards.size else 0.0, "formatted": formatted,
          "tool_use": float(np.mean([t.info.get("tool_calls", 0) > 0 for t in trajs])),
          "response_tokens": float(np.mean([t.num_action_tokens for t in trajs])),
          "n": len(trajs), "trajectories": trajs}
