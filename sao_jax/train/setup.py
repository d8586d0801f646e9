"""What the driver builds from the config: the policy (checkpoint, GGUF, or random + SFT warm
start), the critic, the learner on its mesh, the engines, the trajectory source, and greedy
evaluation. Each function reads the config fields it names and nothing else."""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sao_jax import build, faults, pretrained
from sao_jax.models.transformer import Critic, ModelConfig, Transformer
from sao_jax.rollout.engine import SAOEngine
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


def sft_key(config, mcfg) -> str:
  """The identity of a warm start (its ``sft.cache_dir`` file name): the ``sft`` and ``task``
  fields, the model and the seed -- not where it is cached (``sft.cache_dir``) nor
  ``task.prompt_pool`` (which prompts RL cycles over)."""
  sft = {k: v for k, v in config.sft.to_dict().items() if k != "cache_dir"}
  task = {k: v for k, v in config.task.to_dict().items() if k != "prompt_pool"}
  return sft_lib.cache_key(sft, task, str(mcfg), config.seed)


def build_policy(config, task, warm_start: bool = True, mesh=None) -> Policy:
  """The policy from ``model.checkpoint_dir`` / ``model.gguf`` (Hugging Face folder, GGUF, or a
  sao_jax run checkpoint), else a random init of ``config.model`` warm-started by SFT on the
  task's demonstrations (``sft.*``; cached under ``sft.cache_dir``) when ``warm_start``.
  ``mesh`` (the learner's, ``make_mesh``): a Hugging Face / GGUF checkpoint is loaded straight
  into its shardings there (``pretrained.load_model``); None = one device."""
  loaded = pretrained.load_model(config, mesh)  # HF checkpoint folder / GGUF, else None
  if loaded:
    mcfg, params = loaded
    graphdef = nnx.split(nnx.eval_shape(lambda: Transformer(mcfg, rngs=nnx.Rngs(0))))[0]
    return Policy(mcfg, graphdef, params, f"{pretrained.source(config)} checkpoint", True)
  mcfg = pretrained.model_config(config, task.tokenizer.vocab_size)
  graphdef, params = nnx.split(Transformer(mcfg, rngs=nnx.Rngs(config.seed)))
  params = nnx.to_pure_dict(params)
  if config.model.checkpoint_dir:
    return Policy(mcfg, graphdef, load_policy_params(config.model.checkpoint_dir, params),
                  config.model.checkpoint_dir, True)
  if not (task.sft_demos and config.sft.steps > 0 and warm_start):
    return Policy(mcfg, graphdef, params, "random init")
  t0 = time.time()
  bar = Progress(config.sft.steps, desc="SFT warm-up", mode=config.log.progress)
  params, loss = sft_lib.cached_sft(
      config.sft.cache_dir,
      sft_key(config, mcfg),
      params, lambda: sft_lib.train_sft(
          graphdef, params, task.sft_demos, pad_id=task.tokenizer.pad_id,
          steps_=config.sft.steps, batch_size=config.sft.batch_size, lr=config.sft.lr,
          seed=config.seed, log_every=max(1, config.sft.steps // 5),
          log=lambda msg: print(msg, file=bar.stream, flush=True), on_step=lambda i: bar.update()))
  bar.close()
  print(f"sft warm-up: {config.sft.steps} steps, final loss {loss:.4f}"
        f"{' (cached: ' + config.sft.cache_dir + ')' if np.isnan(loss) else ''}, "
        f"{time.time() - t0:.1f}s", flush=True)
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


def make_mesh(config) -> Optional[jax.sharding.Mesh]:
  """The mesh of ``mesh.shape`` ("fsdp=-1", "fsdp=2,tensor=2,expert=2", ...); None when empty
  (the learner then uses one device)."""
  shape = distributed.parse_mesh_shape(config.mesh.shape)
  return sharding.make_mesh(shape) if shape else None


def make_learner(config, policy: Policy, pad_id: int, mesh=None) -> Learner:
  """The learner for ``config.train`` on ``mesh`` (default ``make_mesh(config)``), with a critic
  initialised from the policy when the estimator needs one. Params already sharded on that mesh
  (``build_policy(..., mesh=)``) are copied device to device, never through one device."""
  cfg = LearnerConfig.from_config(config)
  critic = (critic_from_policy(policy.mcfg, policy.params, config.seed + 1)
            if cfg.spec.uses_critic else (None, None))
  return Learner(cfg, policy.graphdef, policy.params, *critic, pad_id=pad_id,
                 vocab_size=policy.mcfg.vocab_size,
                 mesh=mesh if mesh is not None else make_mesh(config))


def make_engine(config, policy: Policy, tokenizer, *, slots: int, temperature: float,
                seed: Optional[int] = None) -> SAOEngine:
  """A JetStream-API ``SAOEngine`` over the policy's graphdef."""
  return SAOEngine(policy.mcfg, policy.graphdef, tokenizer, max_concurrent_decodes=slots,
                   max_prefill_length=config.rollout.max_prefill_length,
                   temperature=temperature, seed=config.seed if seed is None else seed)


def make_source(config, task, policy: Policy, params, version: int, ledger: PromptLedger,
                spec, *, start_step: int = 0, run_dir: str = ""):
  """The trajectory source of ``rollout.backend`` ("thread": a rollout worker thread in this
  process; "ray": ``rollout.num_workers`` Ray rollout actors) with the mode's groups / barrier
  (``spec``), the staleness policy and the ledger."""
  policy_name = config.rollout.staleness_policy
  eta = config.rollout.max_staleness
  if config.rollout.backend == "ray":  # N rollout actors (rollout/ray_source.py)
    from sao_jax.rollout.ray_source import RaySource  # pylint: disable=import-outside-toplevel  (ray is heavy and optional)
    return RaySource(config, policy.mcfg, ledger, params, version, group_size=spec.group_size,
                     synchronous=spec.synchronous, batch_size=config.train.batch_size,
                     staleness_policy=policy_name, max_staleness=eta, run_dir=run_dir)
  engine = make_engine(config, policy, task.tokenizer, slots=config.rollout.slots,
                       temperature=config.rollout.temperature)
  seed = faults.step_seed(config.seed, start_step) if start_step else config.seed
  engine.reseed(seed)
  env, env_workers = build.rollout_env(config, task.env, config.seed)
  return ThreadSource(
      engine, env, ledger, params, version, stop_ids=task.stop_ids,
      max_new_tokens=config.rollout.max_new_tokens, max_seq_len=config.model.max_seq_len,
      temperature=config.rollout.temperature, batch_size=config.train.batch_size,
      group_size=spec.group_size, synchronous=spec.synchronous,
      queue_size=config.rollout.queue_size,
      staleness_policy=policy_name, max_staleness=eta,
      kv_on_update=config.rollout.kv_on_update, env_workers=env_workers,
      seed=seed, lockstep=config.rollout.lockstep,
      lockstep_delay=config.rollout.lockstep_delay, run_dir=run_dir,
      stop_strings=task.stop_strings, decode_steps=config.rollout.decode_steps)


def evaluate(engine, task, params, problems, config, version: int = 0) -> dict:
  """Greedy pass@1 on ``problems`` through the engine; also tool-use rate and mean length."""
  env = task.eval_env if getattr(task, "eval_env", None) is not None else task.env
  trajs = generate_trajectories(engine, env, params, problems, stop_ids=task.stop_ids,
                                max_new_tokens=config.rollout.max_new_tokens,
                                max_seq_len=config.model.max_seq_len, temperature=0.0,
                                version=version, stop_strings=task.stop_strings,
                                env_workers=env_workers_for(config),
                                decode_steps=config.rollout.decode_steps)
  rewards = np.array([t.reward for t in trajs], np.float64)
  return {"accuracy": float(rewards.mean()) if rewards.size else 0.0,
          "tool_use": float(np.mean([t.info.get("tool_calls", 0) > 0 for t in trajs])),
          "response_tokens": float(np.mean([t.num_action_tokens for t in trajs])),
          "n": len(trajs), "trajectories": trajs}
