"""The inference host as a subprocess: JetStream's client API generates against it, and 5 SAO steps
are fed by its trajectory stream; received log-probs equal a recomputation with the weights of the
version that sampled each token; weights travel over gRPC and over a shared checkpoint path."""

import os
import subprocess
import sys
import time

import jax
import numpy as np
import portpicker
from flax import nnx

from sao_jax.models.transformer import Transformer, default_positions
from sao_jax.rollout import client
from sao_jax.rollout.staleness import StalenessStats, take_batch
from sao_jax.rollout.sync import TrajectoryQueue
from sao_jax.train.loop import critic_from_policy, model_config
from sao_jax.train.sao import SAOConfig, SAOTrainer
from sao_jax.train.steps import token_logprobs
from sao_jax import tasks
from rollout_fixtures import host_config, host_overrides

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OVERRIDES = host_overrides(rollout__kv_on_update="recompute")


def _config():
  return host_config(rollout__kv_on_update="recompute")


def test_grpc_host_feeds_five_sao_steps(tmp_path):
  port, rl_port = portpicker.pick_unused_port(), portpicker.pick_unused_port()
  weights_dir = str(tmp_path / "weights")
  proc = subprocess.Popen(
      [sys.executable, "-m", "sao_jax.rollout.host", "--config=configs/arith_tool.py:smoke",
       f"--port={port}", f"--rl_port={rl_port}", f"--weights_dir={weights_dir}", *OVERRIDES],
      cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  pool = None
  try:
    config = _config()
    task = tasks.make_task(config)
    mcfg = model_config(config, task.tokenizer.vocab_size)
    graphdef, params = nnx.split(Transformer(mcfg, rngs=nnx.Rngs(config.seed + 1)))
    params = nnx.to_pure_dict(params)
    critic_graphdef, critic_params = critic_from_policy(mcfg, params, 2)
    t = config.train
    trainer = SAOTrainer(SAOConfig(policy_lr=1e-3, critic_lr=1e-3, temperature=1.0,
                                   batch_length=mcfg.max_seq_len),
                         graphdef, params, critic_graphdef, critic_params,
                         pad_id=task.tokenizer.pad_id)
    queue = TrajectoryQueue(2)
    pool = client.HostPool([f"localhost:{rl_port}"], queue)
    status = pool.wait_ready(timeout=180)
    assert status[0]["version"] == -1  # the host's own init: serving only, no rollouts yet

    # plain generation through JetStream's client API (Orchestrator.Decode)
    client.wait_for_port(f"localhost:{port}")
    text, ids = client.decode(f"localhost:{port}", text="Compute 1+2.", max_tokens=20)
    assert len(ids) >= 1 and all(0 <= i < mcfg.vocab_size for i in ids)
    assert text == task.tokenizer.decode(ids)

    versions = {0: jax.tree.map(np.asarray, trainer.policy_params_copy())}
    pool.publish(versions[0], 0)
    pool.start()
    stats, received = StalenessStats(), []
    for step in range(1, 6):
      trajs, _, _ = take_batch(queue, t.batch_size, step - 1, stats=stats, on_empty=pool.check)
      received += trajs
      metrics = trainer.step(trajs, policy_version=step - 1)
      assert np.isfinite(metrics["policy_loss"]) and np.isfinite(metrics["value_loss"])
      versions[step] = jax.tree.map(np.asarray, trainer.policy_params_copy())
      if step <= 3:
        pool.publish(versions[step], step)  # over gRPC
      else:
        client.CheckpointPublisher(weights_dir).publish(versions[step], step)  # shared path
    assert stats.accepted == 5 * t.batch_size
    # the shared-path publications reached the host
    deadline = time.time() + 60
    while pool.status()[0]["version"] < 5 and time.time() < deadline:
      time.sleep(0.2)
    assert pool.status()[0]["version"] == 5

    # every action token's log-prob equals a recomputation with the weights that sampled it
    worst, checked, seen_versions = 0.0, 0, set()
    for traj in received:
      mask = traj.action_mask > 0
      assert mask.any() and traj.info["host"]
      tokens = traj.tokens[None]
      for v in np.unique(traj.policy_version[mask]):
        seen_versions.add(int(v))
        logits, _ = nnx.merge(graphdef, versions[int(v)])(tokens, default_positions(tokens))
        rec = np.asarray(token_logprobs(logits, tokens, 1.0))[0]
        sel = mask & (traj.policy_version == v)
        worst = max(worst, float(np.abs(rec[sel] - traj.logprobs[sel]).max()))
        checked += int(sel.sum())
    print(f"checked {checked} tokens over versions {sorted(seen_versions)}: max |diff| {worst:.2e}")
    assert worst < 1e-5 and checked > 100
    assert len(seen_versions) >= 2
  finally:
    if pool is not None:
      pool.stop()
    proc.terminate()
    try:
      out, _ = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
      proc.kill()
      out, _ = proc.communicate()
    if sys.exc_info()[0] is not None:
      print(out[-4000:])
