"""The SAO main job: warm-up, asynchronous rollout -> queue -> trainer, evaluation, checkpoints.

Threads: one rollout worker thread drives the JetStream engine continuously with whatever
weights it has; the main thread consumes trajectories from the bounded queue as they land,
runs SAO policy steps and publishes weights (``policy_version`` + 1 per step). Nothing waits for
a batch's slowest rollout: a step starts as soon as ``batch_size`` trajectories have arrived.

``train.mode`` switches the same loop to a baseline (``sao_jax.train.modes``): ``grpo_async``
feeds each prompt G times and consumes complete groups as they land; ``grpo_sync`` additionally
gates the prompts (``GatedProblems``) so that batch n+1 is admitted only after the weights of
step n are published, and step n+1 waits for the batch's slowest rollout. Every step logs the
timestamps that show it (``traj_t_start_min``, ``traj_t_end_max``, ``step_t_begin``,
``step_t_publish``).
"""

from __future__ import annotations

import csv
import itertools
import os
import queue as queue_lib
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sao_jax.models.transformer import Critic, ModelConfig, Transformer
from sao_jax.rollout.engine import SAOEngine
from sao_jax.rollout import staleness
from sao_jax.rollout.sync import TrajectoryQueue, WeightStore
from sao_jax.rollout.worker import RolloutWorker, env_workers_for, generate_trajectories
from sao_jax.train import distributed
from sao_jax.train import sft as sft_lib
from sao_jax.train.checkpoint import Checkpointer, load_policy_params
from sao_jax.train.metrics import MetricLogger, require_wandb
from sao_jax.train.progress import Progress
from sao_jax.train import modes
from sao_jax.train.sao import SAOConfig, SAOTrainer
from sao_jax import pretrained, tasks
from sao_jax.config_validation import validate_config
from sao_jax.envs.guard import GuardedEnv
from sao_jax.train import resume as resume_lib

CONSOLE_KEYS = ("reward_mean", "eval_accuracy", "masked_fraction", "ratio_max", "value_loss",
                "explained_variance", "staleness_mean", "staleness_max", "tokens_per_s",
                "wait_s", "train_s")


def model_config(config, vocab_size: int) -> ModelConfig:
  m = config.model
  return ModelConfig(vocab_size=vocab_size, d_model=m.d_model, n_layers=m.n_layers,
                     n_heads=m.n_heads, n_kv_heads=m.n_kv_heads, head_dim=m.head_dim,
                     d_ff=m.d_ff, rope_theta=m.rope_theta, max_seq_len=m.max_seq_len,
                     dtype=m.dtype)


def critic_from_policy(mcfg: ModelConfig, policy_params, seed: int):
  """A critic whose backbone starts as a copy of the policy and whose value head is zero."""
  critic = Critic(mcfg, rngs=nnx.Rngs(seed))
  graphdef, params = nnx.split(critic)
  params = nnx.to_pure_dict(params)
  params["backbone"] = jax.tree.map(jnp.copy, policy_params)
  return graphdef, params


def evaluate(engine, task, params, problems, config, version: int = 0) -> dict:
  """Greedy pass@1 on ``problems`` through the engine; also tool-use rate and mean length."""
  env = task.eval_env if getattr(task, "eval_env", None) is not None else task.env
  trajs = generate_trajectories(engine, env, params, problems, stop_ids=task.stop_ids,
                                max_new_tokens=config.rollout.max_new_tokens,
                                max_seq_len=config.model.max_seq_len, temperature=0.0,
                                version=version)
  rewards = np.array([t.reward for t in trajs], np.float64)
  return {"accuracy": float(rewards.mean()) if rewards.size else 0.0,
          "tool_use": float(np.mean([t.info.get("tool_calls", 0) > 0 for t in trajs])),
          "response_tokens": float(np.mean([t.num_action_tokens for t in trajs])),
          "n": len(trajs), "trajectories": trajs}


def mode_fields(tcfg) -> dict:
  """The ``SAOConfig`` fields of the algorithm family from ``config.train`` (absent fields keep
  their SAO defaults, so older configs still run)."""
  g = tcfg.get
  kwargs = {"aggregation": g("aggregation", "token_mean"),
            "entropy_coef": g("entropy_coef", 0.0)}
  if g("loss_norm_constant", 0):
    kwargs["norm_constant"] = g("loss_norm_constant", 0)
  objective = g("objective", "auto")
  resolved = modes.resolve(g("mode", "sao"), objective, g("advantage_estimator", "auto"),
                           g("group_size", 8), g("batch_size", 1)).objective
  if g("dual_clip", 0) and resolved in ("ppo_clip", "tis", "icepop"):
    kwargs["dual_clip"] = g("dual_clip", 0)
  if resolved == "tis":
    kwargs["tis_cap"] = g("tis_cap", 2.0)
  if resolved == "icepop":
    kwargs.update(icepop_low=g("icepop_low", 0.5), icepop_high=g("icepop_high", 5.0))
  return dict(mode=g("mode", "sao"), objective=objective,
              advantage_estimator=g("advantage_estimator", "auto"),
              group_size=g("group_size", 8), batch_size=g("batch_size", 0),
              objective_kwargs=kwargs, ppo_eps_low=g("ppo_eps_low", 0.2),
              ppo_eps_high=g("ppo_eps_high", 0.28),
              baseline_window=g("baseline_window", 8),
              global_baseline_window=g("global_baseline_window", 128),
              bootstrap_truncated=g("bootstrap_truncated", False), kl_coef=g("kl_coef", 0.0))


def _cycle(problems, seed):
  rng = np.random.default_rng(seed)
  for epoch in itertools.count():
    del epoch
    for i in rng.permutation(len(problems)):
      yield problems[i]


def run(config) -> dict[str, Any]:
  """Runs the whole job described by ``config``; returns a summary dict (also written to CSV)."""
  t_job = time.time()
  validate_config(config)  # [reliability] every bad field in one error, before any compilation
  distributed.initialize(config.get("distributed"))  # no-op without a coordinator address
  run_dir = config.run_dir
  os.makedirs(run_dir, exist_ok=True)
  # [reliability] resume from the latest complete checkpoint of run_dir (train/resume.py), only
  # if it was made with the same config (up to run length, checkpointing, logging, eval)
  ckpt_dir = os.path.join(run_dir, "checkpoints")
  resume_step = (resume_lib.resume_point(ckpt_dir) if config.checkpoint.get("resume", True)
                 else None)
  config_json = config.to_json_best_effort(indent=2)  # the resolved config, overrides included
  resume_lib.check_resume_config(run_dir, config_json, resume_step, config.train.num_steps)
  with open(os.path.join(run_dir, "config.json"), "w", encoding="utf-8") as f:
    f.write(config_json)
  if config.log.get("wandb_project", ""):
    require_wandb()  # fail now, not after the warm-up
  task = tasks.make_task(config)
  if resume_step is not None:
    print(f"resuming from {ckpt_dir} step {resume_step}", flush=True)
  # records of steps after the checkpoint (all, on a fresh start) are dropped and redone
  for name in ("metrics.jsonl", "ledger.jsonl"):
    resume_lib.truncate_jsonl(os.path.join(run_dir, name),
                              -1 if resume_step is None else resume_step)
  loaded = pretrained.load_model(config)  # HF checkpoint folder / GGUF, else None
  mcfg = loaded[0] if loaded else model_config(config, task.tokenizer.vocab_size)
  print(f"task {config.task.name}: {len(task.train_problems)} train / {len(task.eval_problems)} "
        f"eval problems; model {mcfg}", flush=True)

  # ---- policy: init (+ SFT warm-up) -------------------------------------------------------------
  if loaded:
    policy_graphdef = nnx.split(nnx.eval_shape(lambda: Transformer(mcfg, rngs=nnx.Rngs(0))))[0]
    policy_params = loaded[1]
    print(f"policy loaded from {pretrained.source(config)} checkpoint", flush=True)
  else:
    policy = Transformer(mcfg, rngs=nnx.Rngs(config.seed))
    policy_graphdef, policy_params = nnx.split(policy)
    policy_params = nnx.to_pure_dict(policy_params)
  if config.model.checkpoint_dir and not loaded:
    policy_params = load_policy_params(config.model.checkpoint_dir, policy_params)
    print(f"policy loaded from {config.model.checkpoint_dir}", flush=True)
  elif task.sft_demos and config.sft.steps > 0 and resume_step is None:
    t0 = time.time()
    sft_progress = Progress(config.sft.steps, desc="SFT warm-up",
                            mode=config.log.get("progress", "auto"))
    init_params = policy_params
    policy_params, loss = sft_lib.cached_sft(
        config.sft.get("cache_dir", ""),
        sft_lib.cache_key(config.sft.to_dict(), config.task.to_dict(), str(mcfg), config.seed),
        init_params, lambda: sft_lib.train_sft(
            policy_graphdef, init_params, task.sft_demos, pad_id=task.tokenizer.pad_id,
            steps_=config.sft.steps, batch_size=config.sft.batch_size, lr=config.sft.lr,
            seed=config.seed, log_every=max(1, config.sft.steps // 5),
            log=lambda msg: print(msg, file=sft_progress.stream, flush=True),
            on_step=lambda i: sft_progress.update()))
    sft_progress.close()
    print(f"sft warm-up: {config.sft.steps} steps, final loss {loss:.4f}"
          f"{' (cached: ' + config.sft.cache_dir + ')' if np.isnan(loss) else ''}, "
          f"{time.time() - t0:.1f}s", flush=True)
  critic_graphdef, critic_params = critic_from_policy(mcfg, policy_params, config.seed + 1)

  engine = SAOEngine(mcfg, policy_graphdef, task.tokenizer,
                     max_concurrent_decodes=config.rollout.slots,
                     max_prefill_length=config.rollout.max_prefill_length,
                     temperature=config.rollout.temperature, seed=config.seed)
  eval_engine = SAOEngine(mcfg, policy_graphdef, task.tokenizer,
                          max_concurrent_decodes=config.eval.slots,
                          max_prefill_length=config.rollout.max_prefill_length,
                          temperature=0.0, seed=config.seed)

  t0 = time.time()
  before = (evaluate(eval_engine, task, policy_params, task.eval_problems, config)
            if resume_step is None else None)
  if before is not None:
    print(f"eval before SAO: accuracy {before['accuracy']:.3f} tool_use {before['tool_use']:.3f} "
          f"on {before['n']} problems ({time.time() - t0:.1f}s)", flush=True)

  tcfg = config.train
  sao_cfg = SAOConfig(eps_low=tcfg.eps_low, eps_high=tcfg.eps_high, gamma=tcfg.gamma,
                      lam_policy=tcfg.lam_policy, lam_alpha=tcfg.lam_alpha,
                      critic_updates_per_step=tcfg.critic_updates_per_step,
                      policy_lr=tcfg.policy_lr, critic_lr=tcfg.critic_lr,
                      critic_lr_warmup_steps=tcfg.critic_lr_warmup_steps,
                      max_grad_norm=tcfg.max_grad_norm,
                      freeze_critic_attention=tcfg.freeze_critic_attention,
                      critic_frozen_patterns=tuple(tcfg.get("critic_frozen_patterns",
                                                            (r"/attn/",))),
                      temperature=config.rollout.temperature,
                      batch_length=config.model.max_seq_len, **mode_fields(tcfg))
  # one device: SAOTrainer; mesh.shape set: ShardedSAOTrainer (train/distributed.py)
  trainer = distributed.make_trainer(config.get("mesh"), sao_cfg, policy_graphdef, policy_params,
                                     critic_graphdef, critic_params, task.tokenizer.pad_id,
                                     tcfg.batch_size)
  local_batch = getattr(trainer, "local_batch_size", tcfg.batch_size)  # per process
  progress = Progress(tcfg.num_steps, desc="SAO steps", mode=config.log.get("progress", "auto"))
  logger = distributed.main_process_logger(
      run_dir, console_keys=CONSOLE_KEYS, tensorboard=config.log.tensorboard,
      stream=progress.stream, wandb_project=config.log.get("wandb_project", "") or None,
      wandb_config=config.to_dict())
  ckpt = (Checkpointer(ckpt_dir, max_to_keep=config.checkpoint.get("max_to_keep", 2))
          if config.checkpoint.every_steps or resume_step is not None else None)
  ledger = resume_lib.PromptLedger(task.train_problems, config.seed + jax.process_index())
  guard = resume_lib.NonFiniteGuard(config.train.get("max_consecutive_nonfinite", 3))
  start_step, version = 0, 0
  if resume_step is not None:  # [reliability] restore trainer, counters, data cursor
    meta = ckpt.meta(resume_step)
    restored = ckpt.restore({"policy": trainer.policy, "critic": trainer.critic,
                             "meta": {"policy_version": np.zeros((), np.int64),
                                      "step": np.zeros((), np.int64)}},
                            resume_step)
    trainer.policy, trainer.critic = restored["policy"], restored["critic"]
    start_step, version = int(meta["step"]), int(meta["policy_version"])
    ledger = resume_lib.PromptLedger.from_state(task.train_problems, meta["ledger"])
    guard.total = int(meta.get("nonfinite_total", 0))
    before = meta["before"]
    engine.reseed(resume_lib.step_seed(config.seed, start_step))

  def resume_meta(step):
    return {"step": step, "policy_version": version, "seed": config.seed,
            "ledger": ledger.state(), "nonfinite_total": guard.total,
            "before": {k: before[k] for k in ("accuracy", "tool_use", "n")}}

  # ---- asynchronous rollout ---------------------------------------------------------------------
  traj_queue = TrajectoryQueue(config.rollout.queue_size)
  stop = threading.Event()
  env_workers = env_workers_for(config)  # >0: env.step off the decode loop (slow tool calls)
  env = GuardedEnv(task.env, timeout_s=config.rollout.get("env_timeout_s", 30.0),
                   fault_rate=float(os.environ.get("SAO_FAULT_ENV_RATE", "0")), seed=config.seed,
                   max_workers=max(4, env_workers))
  weights = WeightStore(trainer.policy_params_copy(), version=version)
  lockstep = config.rollout.get("lockstep", False)
  spec = trainer.spec
  if lockstep and spec.group_size > 1:
    raise ValueError("rollout.lockstep=True supports one rollout per prompt only; set "
                     "train.group_size=1 or rollout.lockstep=False.")
  problems = ledger.iterator()
  if spec.group_size > 1:
    problems = modes.repeat_groups(problems, spec.group_size)
  gate = None
  if spec.synchronous:
    problems = gate = modes.GatedProblems(problems)
    gate.release(tcfg.batch_size)
  # staleness control (rollout/staleness.py): AReaL admission and/or GLM-5 drop-on-arrival
  policy = config.rollout.get("staleness_policy", "none")
  eta = config.rollout.get("max_staleness", -1)
  staleness.check_policy(policy, eta)
  drop_eta = eta if "drop" in policy else -1
  admission = (staleness.AdmissionControl(eta, tcfg.batch_size)
               if "admission" in policy else None)
  collector = modes.GroupCollector(spec.group_size)
  dropped = [0]
  worker = RolloutWorker(engine, env, problems,
                         lambda t: traj_queue.put(t, stop), weights, stop_ids=task.stop_ids,
                         max_new_tokens=config.rollout.max_new_tokens,
                         max_seq_len=config.model.max_seq_len,
                         seed=resume_lib.step_seed(config.seed, start_step) if start_step
                         else config.seed,
                         kv_on_update=config.rollout.get("kv_on_update", "keep"),
                         admission=admission, env_workers=0 if lockstep else env_workers)
  thread = None if lockstep else worker.start_thread(stop)

  def take(n: int, step: int = 0):
    """n trajectories (whole groups in the grpo modes), dropping units staler than
    rollout.max_staleness versions (drop policies); records the consumed prompts in the ledger."""
    out, waited, ages = [], 0.0, []
    t0 = time.perf_counter()
    if lockstep:  # [reliability] deterministic rollout, see train/resume.py
      resume_lib.maybe_kill("rollout", step)
      out = resume_lib.lockstep_batch(
          engine, env, trainer.policy_params_copy(), ledger, n, step=step, seed=config.seed,
          version=version, stop_ids=task.stop_ids, max_new_tokens=config.rollout.max_new_tokens,
          max_seq_len=config.model.max_seq_len, temperature=config.rollout.temperature)
      ages = [0.0]
      worker.stats.trajectories += len(out)
    while len(out) < n:
      if len(out) == n // 2:
        resume_lib.maybe_kill("rollout", step)
      try:
        traj, age = traj_queue.get(timeout=1.0)
      except queue_lib.Empty:
        if worker.error is not None or not thread.is_alive():
          raise RuntimeError("the rollout worker stopped: "
                             f"{worker.error!r}") from worker.error
        continue
      ages.append(age)
      for unit in (collector.add(traj) if spec.group_size > 1 else [[traj]]):
        if modes.too_stale(unit, version, drop_eta):
          dropped[0] += len(unit)
          for _ in unit if admission is not None else ():
            admission.revoke()  # dropped work frees its admission place
        else:
          out.extend(unit)
    # one ledger entry per prompt: a group's members carry "<prompt id>#g<ordinal>"
    ids = [t.problem_id.split(modes.GROUP_SEP)[0] for t in out][::spec.group_size]
    positions = ledger.consume(ids)  # [reliability] ledger
    resume_lib.append_ledger(run_dir, step, out[::spec.group_size], positions)
    waited = time.perf_counter() - t0
    return out, waited, float(np.mean(ages))

  history = []
  try:
    for i in range(tcfg.critic_warmup_steps if spec.uses_critic and resume_step is None else 0):
      trajs, _, _ = take(local_batch)
      m = trainer.critic_only_step(trajs)
      logger.log(i, m, prefix="critic_warmup/")
    last_tokens, last_time = worker.stats.tokens_sampled, time.time()
    for step in range(start_step + 1, tcfg.num_steps + 1):
      trajs, wait_s, queue_age = take(local_batch, step)
      t0, step_t_begin = time.perf_counter(), time.time()
      metrics = trainer.step(trajs, policy_version=version)
      resume_lib.maybe_kill("train", step)
      metrics["nonfinite_skipped"] = float(guard.check(step, metrics))  # raises after N in a row
      version += 1
      weights.publish(trainer.policy_params_copy(), version)
      step_t_publish = time.time()
      if gate is not None:  # grpo_sync: the next batch starts only on the new weights
        gate.release(tcfg.batch_size)
      train_s = time.perf_counter() - t0
      now, tokens = time.time(), worker.stats.tokens_sampled
      metrics.update(
          reward_mean=float(np.mean([t.reward for t in trajs])),
          response_tokens_mean=float(np.mean([t.num_action_tokens for t in trajs])),
          tool_use=float(np.mean([t.info.get("tool_calls", 0) > 0 for t in trajs])),
          failed=float(sum(bool(t.info.get("failed")) for t in trajs)),
          env_errors_total=float(worker.stats.env_errors), nonfinite_total=float(guard.total),
          tokens_per_s=(tokens - last_tokens) / max(now - last_time, 1e-9),
          wait_s=wait_s, train_s=train_s, queue_age_s=queue_age, queue_size=traj_queue.qsize(),
          rollout_generate_s=worker.stats.generate_s, rollout_prefill_s=worker.stats.prefill_s,
          rollout_env_wait_s=worker.stats.env_wait_s, rollout_sink_s=worker.sink_s_now(),
          rollout_trajectories=worker.stats.trajectories,
          rollout_idle_s=worker.stats.idle_s, rollout_generate_steps=worker.stats.generate_steps,
          rollout_slot_occupancy=(worker.stats.decode_slot_steps
                                  / max(1, worker.stats.generate_steps * len(worker.slots))),
          policy_version=version, elapsed_s=now - t_job,
          traj_t_start_min=min(t.t_start for t in trajs),
          traj_t_start_max=max(t.t_start for t in trajs),
          traj_t_end_max=max(t.t_end for t in trajs),
          step_t_begin=step_t_begin, step_t_publish=step_t_publish,
          dropped_stale=float(dropped[0]))
      last_tokens, last_time = tokens, now
      if config.eval.every_steps and step % config.eval.every_steps == 0 and step < tcfg.num_steps:
        ev = evaluate(eval_engine, task, trainer.policy_params_copy(),
                      task.eval_problems[:config.eval.periodic_problems], config, version)
        metrics["eval_accuracy"] = ev["accuracy"]
        metrics["eval_tool_use"] = ev["tool_use"]
      logger.log(step, metrics)
      history.append(metrics)
      progress.update(reward=metrics["reward_mean"], staleness=metrics["staleness_mean"],
                      rollouts=worker.stats.trajectories, tok_s=round(metrics["tokens_per_s"]))
      if ckpt and config.checkpoint.every_steps and step % config.checkpoint.every_steps == 0:
        ckpt.save(step, {"policy": trainer.policy, "critic": trainer.critic,
                         "meta": {"policy_version": np.int64(version), "step": np.int64(step)}},
                  meta=resume_meta(step))
        resume_lib.maybe_kill("checkpoint", step)
  finally:
    progress.close()
    stop.set()
    if thread is not None:
      thread.join(timeout=30)

  if ckpt:
    if ckpt.latest_step() != tcfg.num_steps:
      ckpt.save(tcfg.num_steps, {"policy": trainer.policy, "critic": trainer.critic,
                                 "meta": {"policy_version": np.int64(version),
                                          "step": np.int64(tcfg.num_steps)}},
                meta=resume_meta(tcfg.num_steps))
    ckpt.close()

  t0 = time.time()
  after = evaluate(eval_engine, task, trainer.policy_params_copy(), task.eval_problems, config,
                   version)
  print(f"eval after SAO: accuracy {after['accuracy']:.3f} ({time.time() - t0:.1f}s)", flush=True)
  logger.log(tcfg.num_steps, {"eval_accuracy": after["accuracy"], "eval_tool_use": after["tool_use"]},
             prefix="final/")
  csv_path = logger.close()

  staleness_max = max((h["staleness_max"] for h in history), default=0.0)
  summary = {
      "accuracy_before": before["accuracy"], "accuracy_after": after["accuracy"],
      "tool_use_before": before["tool_use"], "tool_use_after": after["tool_use"],
      "eval_problems": after["n"], "policy_steps": tcfg.num_steps,
      "trajectories_consumed": tcfg.batch_size * (tcfg.num_steps + tcfg.critic_warmup_steps),
      "env_errors": worker.stats.env_errors, "nonfinite_skipped": guard.total,
      "trajectories_generated": worker.stats.trajectories,
      "staleness_max": staleness_max,
      "steps_with_stale_tokens": int(sum(h["staleness_max"] > 0 for h in history)),
      "wall_s": time.time() - t_job, "metrics_csv": csv_path,
  }
  if distributed.is_main_process():
    write_summary(os.path.join(run_dir, "results.csv"), summary)
    print_table(summary)
  return summary


def write_summary(path: str, summary: dict) -> None:
  with open(path, "w", newline="", encoding="utf-8") as f:
    w = csv.writer(f)
    w.writerow(["metric", "value"])
    for k, v in summary.items():
      w.writerow([k, v])


def print_table(summary: dict) -> None:
  b, a = summary["accuracy_before"], summary["accuracy_after"]
  rows = [("greedy accuracy", f"{100 * b:.1f}%", f"{100 * a:.1f}%", f"{100 * (a - b):+.1f} pts"),
          ("tool use", f"{100 * summary['tool_use_before']:.1f}%",
           f"{100 * summary['tool_use_after']:.1f}%",
           f"{100 * (summary['tool_use_after'] - summary['tool_use_before']):+.1f} pts")]
  print(f"\nHeld-out evaluation ({summary['eval_problems']} problems, greedy, math-verify):")
  print(f"{'':18s}{'warm start':>12s}{'after SAO':>12s}{'change':>12s}")
  for r in rows:
    print(f"{r[0]:18s}{r[1]:>12s}{r[2]:>12s}{r[3]:>12s}")
  print(f"policy steps {summary['policy_steps']}, trajectories consumed "
        f"{summary['trajectories_consumed']} / generated {summary['trajectories_generated']}, "
        f"max staleness {summary['staleness_max']:.0f}, wall {summary['wall_s']:.0f}s", flush=True)
