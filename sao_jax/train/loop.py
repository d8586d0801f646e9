"""The driver: source.take -> learner.step -> publish weights -> hooks (log, eval, checkpoint).

Nothing waits for a batch's slowest rollout: the source hands over ``batch_size`` trajectories
as soon as they have landed (whole groups in the grpo modes; ``grpo_sync`` adds the barrier),
the learner runs one policy step of the configured mode on any mesh, and the new weights go
back to the rollout side as ``policy_version`` + 1. ``run`` converts the config once, at its
top, into the typed roles (``sao_jax/roles.py``); what is built from them is in
``sao_jax/build.py`` (the composition root); the end-of-run table in ``train/report.py``.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from typing import Any

import jax
import numpy as np

from sao_jax import build, faults, roles, tasks
from sao_jax.train.validation import config_warnings, validate_config
from sao_jax.rollout import placement
from sao_jax.rollout.ledger import PromptLedger
from sao_jax.train import distributed, report
from sao_jax.train import resume as resume_lib
from sao_jax.train.checkpoint import Checkpointer
from sao_jax.train.metrics import make_metric_writer
from sao_jax.train.progress import Progress

CONSOLE_KEYS = ("reward_mean", "eval_accuracy", "masked_fraction", "ratio_max", "value_loss",
                "explained_variance", "staleness_mean", "staleness_max", "tokens_per_s",
                "wait_s", "train_s")


def _trajectory_metrics(trajs) -> dict[str, float]:
  return {"response_tokens_mean": float(np.mean([t.num_action_tokens for t in trajs])),
          "tool_use": float(np.mean([t.info.get("tool_calls", 0) > 0 for t in trajs])),
          "failed": float(sum(bool(t.info.get("failed")) for t in trajs)),
          "truncated_fraction": float(np.mean([bool(t.truncated) for t in trajs])),
          "traj_t_start_min": min(t.t_start for t in trajs),
          "traj_t_start_max": max(t.t_start for t in trajs),
          "traj_t_end_max": max(t.t_end for t in trajs)}


def _formatted(ev: dict) -> dict[str, float]:
  """``{"eval_formatted": ...}`` where the task reports answers, else {} (no NaN logged)."""
  f = ev.get("formatted", float("nan"))
  return {"eval_formatted": f} if np.isfinite(f) else {}


def run(config) -> dict[str, Any]:
  """Runs the whole job described by ``config`` (the user's ml_collections ConfigDict, or a
  ``roles.Run``); returns the summary (also in results.csv).

  The top of the job: ``config`` is validated (every bad field in one ``ConfigError``, before
  anything is built) and converted once into the typed roles; everything below gets those."""
  t_job = time.time()
  user = roles.to_config(config) if isinstance(config, roles.Run) else config
  validate_config(user)
  warnings = config_warnings(user)
  config = roles.from_config(user)  # the one conversion: below here only typed roles
  distributed.initialize(config.distributed)  # no-op without a coordinator address
  for line in warnings if distributed.is_main_process() else ():
    print(line, file=sys.stderr, flush=True)
  run_dir, tcfg = config.run_dir, config.train
  method = "SAO" if tcfg.mode == "sao" else tcfg.mode  # the name the evaluation lines print
  resume_step, ckpt_dir = resume_lib.prepare_run_dir(config)
  task = tasks.make_task(config)
  # the learner's mesh (a checkpoint loads straight into it) and the rollout engine's
  mesh, rollout_mesh = build.make_meshes(config)
  if rollout_mesh is not None:
    print(f"placement: learner on devices {[d.id for d in mesh.devices.flat]} "
          f"{dict(mesh.shape)}, rollout on {[d.id for d in rollout_mesh.devices.flat]} "
          f"{dict(rollout_mesh.shape)}", flush=True)
  t_policy = time.time()
  policy = build.build_policy(config, task, warm_start=resume_step is None, mesh=mesh)
  warm_start_s = time.time() - t_policy  # the SFT warm-up (or its cache load), logged per step
  print(f"task {config.task.name}: {len(task.train_problems)} train / {len(task.eval_problems)} "
        f"eval problems; model {policy.mcfg}", flush=True)
  if resume_step is None:
    print(f"policy loaded from {policy.source}" if policy.loaded else f"policy: {policy.source}",
          flush=True)
  learner = build.make_learner(config, policy, task.tokenizer.pad_id, mesh=mesh)
  policy.params = None  # the learner holds its own (float32 master) copy
  eval_engine = build.make_engine(config, policy.mcfg, policy.graphdef, task.tokenizer,
                                  slots=config.eval.slots, temperature=0.0, mesh=rollout_mesh)
  # a publish: the learner's params cast and moved device to device into the engines' layout
  # (several processes: each gathers the whole tree, as the Ray actors' weight sync needs)
  serving = (placement.serving_shardings(learner.policy.params, rollout_mesh)
             if jax.process_count() == 1 else None)
  publish = lambda: learner.policy_params(serving)
  evaluate = lambda params, problems, version: build.evaluate(eval_engine, task, params,
                                                              problems, config, version)
  ckpt = (Checkpointer(ckpt_dir, max_to_keep=config.checkpoint.max_to_keep)
          if config.checkpoint.every_steps or resume_step is not None else None)
  guard = resume_lib.NonFiniteGuard(config.train.max_consecutive_nonfinite)
  start_step, version, before = 0, 0, None
  pool = task.train_problems[:config.task.prompt_pool or None]  # the prompts RL cycles over
  ledger = PromptLedger(pool, config.seed + jax.process_index())
  eval_total_s = 0.0  # wall seconds spent in held-out evals so far (logged: time-to-accuracy)
  if resume_step is not None:  # restore learner, counters, the prompt ledger's cursor
    meta = ckpt.meta(resume_step)
    learner.load_states(ckpt.restore(learner.restore_target(), resume_step))
    start_step, version, before = int(meta["step"]), int(meta["policy_version"]), meta["before"]
    ledger = PromptLedger.from_state(pool, meta["ledger"])
    guard.total = int(meta.get("nonfinite_total", 0))
    print(f"policy restored from {ckpt_dir} step {start_step}", flush=True)
    if start_step >= tcfg.num_steps and os.path.exists(os.path.join(run_dir, "results.csv")):
      # nothing left to train and the run's summary exists: keep it (a re-run would lose it)
      ckpt.close()
      print(f"the run is complete ({tcfg.num_steps} steps); its results stay in {run_dir}"
            "/results.csv (raise train.num_steps to train further)", flush=True)
      return {}
  else:
    t0 = time.time()
    before = evaluate(publish(), task.eval_problems, 0)
    eval_total_s = time.time() - t0
    print(f"eval before {method}: accuracy {before['accuracy']:.3f} "
          f"tool_use {before['tool_use']:.3f} on {before['n']} problems "
          f"({time.time() - t0:.1f}s)", flush=True)
    before = {k: before[k] for k in ("accuracy", "tool_use", "formatted", "n")
              if k in before and np.isfinite(before[k])}  # JSON meta: no NaN (no answers reported)

  def save(step):
    ckpt.save(step, learner.states(), meta={
        "step": step, "policy_version": version, "seed": config.seed, "ledger": source.state(),
        "nonfinite_total": guard.total, "before": before})

  source = build.make_source(config, task, policy, publish(), version, ledger,
                             learner.spec, start_step=start_step, run_dir=run_dir,
                             mesh=rollout_mesh)
  local_batch = tcfg.batch_size // jax.process_count()
  progress = Progress(tcfg.num_steps, desc=f"{tcfg.mode} steps", mode=config.log.progress)
  logger = make_metric_writer(
      run_dir, console_keys=CONSOLE_KEYS, tensorboard=config.log.tensorboard,
      stream=progress.stream, wandb_project=config.log.wandb_project or None,
      wandb_config=dataclasses.asdict(config))
  history = []
  warmup_steps = tcfg.critic_warmup_steps if learner.uses_critic else 0  # none without a critic
  try:
    for i in range(warmup_steps if resume_step is None else 0):
      # value pre-training on rollouts of the starting policy (no policy update)
      batch, micro = learner.batch(source.take(local_batch, version))
      logger.log(i, learner.critic_only_step(batch, micro), prefix="critic_warmup/")
    task.on_policy_start()  # the task's hook (style_switch: phase 0 starts with step 1)
    for step in range(start_step + 1, tcfg.num_steps + 1):
      trajs = source.take(local_batch, version)
      t0, step_t_begin = time.perf_counter(), time.time()
      metrics = learner.train_step(trajs, version)
      faults.maybe_kill("train", step)
      metrics["nonfinite_skipped"] = float(guard.check(step, metrics))  # raises after N in a row
      version += 1
      source.publish(publish(), version)
      metrics.update(_trajectory_metrics(trajs), **task.batch_metrics(trajs), **source.metrics(),
                     policy_version=version,
                     train_s=time.perf_counter() - t0, elapsed_s=time.time() - t_job,
                     nonfinite_total=float(guard.total), step_t_begin=step_t_begin,
                     step_t_publish=time.time(), eval_total_s=eval_total_s,
                     warm_start_s=warm_start_s)
      if config.eval.every_steps and step % config.eval.every_steps == 0 and step < tcfg.num_steps:
        t_eval = time.time()
        ev = evaluate(publish(), task.eval_problems[:config.eval.periodic_problems],
                      version)
        eval_total_s += time.time() - t_eval
        metrics.update(eval_accuracy=ev["accuracy"], eval_tool_use=ev["tool_use"],
                       **_formatted(ev))
      logger.log(step, metrics)
      history.append(metrics)
      progress.update(reward=metrics["reward_mean"], staleness=metrics["staleness_mean"],
                      rollouts=int(metrics["rollout_trajectories"]),
                      tok_s=round(metrics["tokens_per_s"]))
      if ckpt and config.checkpoint.every_steps and step % config.checkpoint.every_steps == 0:
        save(step)
        faults.maybe_kill("checkpoint", step)
  finally:
    progress.close()
    src = source.metrics()  # the rollout side's totals, before it is stopped
    source.close()
  if ckpt:
    if ckpt.latest_step() != tcfg.num_steps:
      save(tcfg.num_steps)
    ckpt.close()

  t0 = time.time()
  after = evaluate(publish(), task.eval_problems, version)
  print(f"eval after {method}: accuracy {after['accuracy']:.3f} tool_use {after['tool_use']:.3f} "
        f"({time.time() - t0:.1f}s); results in {run_dir}", flush=True)
  logger.log(tcfg.num_steps, {"eval_accuracy": after["accuracy"],
                              "eval_tool_use": after["tool_use"], **_formatted(after)},
             prefix="final/")
  summary = {
      "accuracy_before": before["accuracy"], "accuracy_after": after["accuracy"],
      "tool_use_before": before["tool_use"], "tool_use_after": after["tool_use"],
      "formatted_before": before.get("formatted", float("nan")),
      "formatted_after": after.get("formatted", float("nan")),
      "eval_problems": after["n"], "grader": task.grader, "method": method,
      "policy_steps": tcfg.num_steps,
      "trajectories_consumed": tcfg.batch_size * (tcfg.num_steps + warmup_steps),
      "env_errors": int(src["env_errors_total"]), "nonfinite_skipped": guard.total,
      "trajectories_generated": int(src["rollout_trajectories"]),
      "staleness_max": max((h["staleness_max"] for h in history), default=0.0),
      "steps_with_stale_tokens": int(sum(h["staleness_max"] > 0 for h in history)),
      **{k: src[k] for k in ("response_tokens_generated_mean", "response_tokens_trained_mean",
                             "response_tokens_dropped_mean")},
      "trajectories_dropped": int(src["dropped_stale"]),
      "wall_s": time.time() - t_job, "metrics_csv": logger.close(),
  }
  if distributed.is_main_process():
    summary = report.finish(run_dir, summary)
  return summary
