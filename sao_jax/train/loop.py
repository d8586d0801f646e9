"""The SAO main job: warm-up, asynchronous rollout -> queue -> trainer, evaluation, checkpoints.

Threads: one rollout worker thread drives the JetStream engine continuously with whatever
weights it has; the main thread consumes trajectories from the bounded queue as they land,
runs SAO policy steps and publishes weights (``policy_version`` + 1 per step). Nothing waits for
a batch's slowest rollout: a step starts as soon as ``batch_size`` trajectories have arrived.
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
from sao_jax.rollout.sync import TrajectoryQueue, WeightStore
from sao_jax.rollout.worker import RolloutWorker, generate_trajectories
from sao_jax.train import distributed
from sao_jax.train import sft as sft_lib
from sao_jax.train.checkpoint import Checkpointer, load_policy_params
from sao_jax.train.sao import SAOConfig
from sao_jax import tasks

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
  trajs = generate_trajectories(engine, task.env, params, problems, stop_ids=task.stop_ids,
                                max_new_tokens=config.rollout.max_new_tokens,
                                max_seq_len=config.model.max_seq_len, temperature=0.0,
                                version=version)
  rewards = np.array([t.reward for t in trajs], np.float64)
  return {"accuracy": float(rewards.mean()) if rewards.size else 0.0,
          "tool_use": float(np.mean([t.info.get("tool_calls", 0) > 0 for t in trajs])),
          "response_tokens": float(np.mean([t.num_action_tokens for t in trajs])),
          "n": len(trajs), "trajectories": trajs}


def _cycle(problems, seed):
  rng = np.random.default_rng(seed)
  for epoch in itertools.count():
    del epoch
    for i in rng.permutation(len(problems)):
      yield problems[i]


def run(config) -> dict[str, Any]:
  """Runs the whole job described by ``config``; returns a summary dict (also written to CSV)."""
  t_job = time.time()
  distributed.initialize(config.get("distributed"))  # no-op without a coordinator address
  if not config.model.checkpoint_dir and not config.get("allow_random_init", False):
    raise ValueError("this config starts RL from a trained policy: set "
                     "--config.model.checkpoint_dir=<sao_jax checkpoint folder> "
                     "(or use the ':smoke' variant for a tiny random model).")
  run_dir = config.run_dir
  os.makedirs(run_dir, exist_ok=True)
  task = tasks.make_task(config)
  mcfg = model_config(config, task.tokenizer.vocab_size)
  print(f"task {config.task.name}: {len(task.train_problems)} train / {len(task.eval_problems)} "
        f"eval problems; model {mcfg}", flush=True)

  # ---- policy: init (+ SFT warm-up) -------------------------------------------------------------
  policy = Transformer(mcfg, rngs=nnx.Rngs(config.seed))
  policy_graphdef, policy_params = nnx.split(policy)
  policy_params = nnx.to_pure_dict(policy_params)
  if config.model.checkpoint_dir:
    policy_params = load_policy_params(config.model.checkpoint_dir, policy_params)
    print(f"policy loaded from {config.model.checkpoint_dir}", flush=True)
  elif task.sft_demos and config.sft.steps > 0:
    t0 = time.time()
    policy_params, loss = sft_lib.train_sft(
        policy_graphdef, policy_params, task.sft_demos, pad_id=task.tokenizer.pad_id,
        steps_=config.sft.steps, batch_size=config.sft.batch_size, lr=config.sft.lr,
        seed=config.seed, log_every=max(1, config.sft.steps // 5))
    print(f"sft warm-up: {config.sft.steps} steps, final loss {loss:.4f}, "
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
  before = evaluate(eval_engine, task, policy_params, task.eval_problems, config)
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
                      temperature=config.rollout.temperature,
                      batch_length=config.model.max_seq_len)
  trainer = distributed.make_trainer(config.get("mesh"), sao_cfg, policy_graphdef, policy_params,
                                     critic_graphdef, critic_params, task.tokenizer.pad_id,
                                     tcfg.batch_size)
  local_batch = getattr(trainer, "local_batch_size", tcfg.batch_size)  # per process
  logger = distributed.main_process_logger(run_dir, console_keys=CONSOLE_KEYS,
                                           tensorboard=config.log.tensorboard)
  ckpt = Checkpointer(os.path.join(run_dir, "checkpoints")) if config.checkpoint.every_steps else None

  # ---- asynchronous rollout ---------------------------------------------------------------------
  weights = WeightStore(trainer.policy_params_copy(), version=0)
  traj_queue = TrajectoryQueue(config.rollout.queue_size)
  stop = threading.Event()
  worker = RolloutWorker(engine, task.env,
                         _cycle(task.train_problems, config.seed + jax.process_index()),
                         lambda t: traj_queue.put(t, stop), weights, stop_ids=task.stop_ids,
                         max_new_tokens=config.rollout.max_new_tokens,
                         max_seq_len=config.model.max_seq_len, seed=config.seed)
  thread = worker.start_thread(stop)
  version = 0

  def take(n: int):
    out, waited, ages = [], 0.0, []
    t0 = time.perf_counter()
    while len(out) < n:
      try:
        traj, age = traj_queue.get(timeout=1.0)
      except queue_lib.Empty:
        if worker.error is not None or not thread.is_alive():
          raise RuntimeError("the rollout worker stopped: "
                             f"{worker.error!r}") from worker.error
        continue
      out.append(traj)
      ages.append(age)
    waited = time.perf_counter() - t0
    return out, waited, float(np.mean(ages))

  history = []
  try:
    for i in range(tcfg.critic_warmup_steps):
      trajs, _, _ = take(local_batch)
      m = trainer.critic_only_step(trajs)
      logger.log(i, m, prefix="critic_warmup/")
    last_tokens, last_time = worker.stats.tokens_sampled, time.time()
    for step in range(1, tcfg.num_steps + 1):
      trajs, wait_s, queue_age = take(local_batch)
      t0 = time.perf_counter()
      metrics = trainer.step(trajs, policy_version=version)
      version += 1
      weights.publish(trainer.policy_params_copy(), version)
      train_s = time.perf_counter() - t0
      now, tokens = time.time(), worker.stats.tokens_sampled
      metrics.update(
          reward_mean=float(np.mean([t.reward for t in trajs])),
          response_tokens_mean=float(np.mean([t.num_action_tokens for t in trajs])),
          tool_use=float(np.mean([t.info.get("tool_calls", 0) > 0 for t in trajs])),
          failed=float(sum(bool(t.info.get("failed")) for t in trajs)),
          tokens_per_s=(tokens - last_tokens) / max(now - last_time, 1e-9),
          wait_s=wait_s, train_s=train_s, queue_age_s=queue_age, queue_size=traj_queue.qsize(),
          rollout_generate_s=worker.stats.generate_s, rollout_prefill_s=worker.stats.prefill_s,
          policy_version=version, elapsed_s=now - t_job)
      last_tokens, last_time = tokens, now
      if config.eval.every_steps and step % config.eval.every_steps == 0 and step < tcfg.num_steps:
        ev = evaluate(eval_engine, task, trainer.policy_params_copy(),
                      task.eval_problems[:config.eval.periodic_problems], config, version)
        metrics["eval_accuracy"] = ev["accuracy"]
        metrics["eval_tool_use"] = ev["tool_use"]
      logger.log(step, metrics)
      history.append(metrics)
      if ckpt and step % config.checkpoint.every_steps == 0:
        ckpt.save(step, {"policy": trainer.policy, "critic": trainer.critic,
                         "meta": {"policy_version": np.int64(version), "step": np.int64(step)}})
  finally:
    stop.set()
    thread.join(timeout=30)

  if ckpt:
    ckpt.save(tcfg.num_steps, {"policy": trainer.policy, "critic": trainer.critic,
                               "meta": {"policy_version": np.int64(version),
                                        "step": np.int64(tcfg.num_steps)}})
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
