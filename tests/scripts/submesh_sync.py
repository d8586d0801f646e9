"""Run by tests/unit/rollout/test_placement.py with 8 forced CPU devices: engine on 4, trainer on 4;
weights
published device to device into the engine's layout (``Learner.policy_params(shardings)``)."""
import dataclasses
import json
import os
import sys
import threading
import time

import jax
from flax import nnx

from sao_jax.build import critic_from_policy
from sao_jax.models.transformer import ModelConfig, Transformer
from sao_jax.rollout.engine import SAOEngine
from sao_jax.rollout import placement
from sao_jax.rollout.sync import TrajectoryQueue, WeightStore
from sao_jax.roles import from_config
from sao_jax.rollout.worker import RolloutWorker
from sao_jax.train import sharding
from sao_jax.train.learner import Learner, LearnerConfig

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import sharding_helpers  # noqa: E402  (tests/: the reference config)

CFG = ModelConfig(vocab_size=40, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                  d_ff=64, max_seq_len=48)


class Tok:
  pad_id, bos_id, eos_id = 0, 1, 2

  def decode(self, ids):
    return "".join(chr(97 + (i % 26)) for i in ids)


@dataclasses.dataclass(frozen=True)
class Step:
  observation_ids: list
  done: bool
  reward: float
  info: dict


class Env:
  max_turns = 2

  def prompt_ids(self, p):
    return [1, 10 + p % 20, 11]

  def step(self, p, turn, action_ids):
    if turn == 0:
      return Step([6, 7], False, 0.0, {})
    return Step([], True, float(len(action_ids) % 3 == 0), {})


def main():
  assert len(jax.devices()) == 8
  engine_devices, train_devices = placement.split_devices(jax.devices(), 4)
  engine_mesh = placement.rollout_mesh("data=-1", engine_devices)
  train_mesh = sharding.make_mesh({"data": -1}, devices=train_devices)
  graphdef, params = nnx.split(Transformer(CFG, rngs=nnx.Rngs(0)))
  params = nnx.to_pure_dict(params)
  cg, cp = critic_from_policy(CFG, params, 1)
  config = sharding_helpers.arith_config()
  config.model.max_seq_len = 48
  config.train.policy_lr = config.train.critic_lr = 1e-3
  trainer = Learner(LearnerConfig.from_run(from_config(config)), graphdef, params, cg, cp, pad_id=0,
                    mesh=train_mesh)
  serving = placement.serving_shardings(trainer.policy.params, engine_mesh)
  store = WeightStore(trainer.policy_params(serving), 0)
  engine = SAOEngine(CFG, graphdef, Tok(), max_concurrent_decodes=8, max_prefill_length=16,
                     mesh=engine_mesh)
  gen_intervals = []
  orig = engine.generate_steps  # what the rollout worker calls (tokens come back on the host)

  def timed_generate(p, state, num_steps, temperature=None):
    t0 = time.time()
    out = orig(p, state, num_steps, temperature)
    gen_intervals.append((t0, time.time()))
    return out

  engine.generate_steps = timed_generate
  queue = TrajectoryQueue(4)
  stop = threading.Event()
  problems = iter(range(10**6))
  worker = RolloutWorker(engine, Env(), problems, lambda t: queue.put(t, stop), store,
                         stop_ids=(2, 5), max_new_tokens=8, max_seq_len=CFG.max_seq_len)
  thread = worker.start_thread(stop)
  train_intervals, versions_seen = [], set()
  for step in range(1, 6):
    trajs = [queue.get(timeout=120)[0] for _ in range(8)]
    for t in trajs:
      versions_seen.update(t.policy_version[t.action_mask > 0].tolist())
    t0 = time.time()
    trainer.train_step(trajs, policy_version=step - 1)
    jax.block_until_ready(trainer.policy.params)
    train_intervals.append((t0, time.time()))
    store.publish(trainer.policy_params(serving), step)
  stop.set()
  thread.join(30)
  overlap = sum(max(0.0, min(a1, b1) - max(a0, b0))
                for a0, a1 in gen_intervals for b0, b1 in train_intervals)
  gens_during_train = sum(any(b0 <= (a0 + a1) / 2 <= b1 for b0, b1 in train_intervals)
                          for a0, a1 in gen_intervals)
  engine_params, _ = store.latest()
  leaf = jax.tree.leaves(engine_params)[0]
  tleaf = jax.tree.leaves(trainer.policy.params)[0]
  print(json.dumps({
      "engine_devices": sorted(d.id for d in leaf.sharding.device_set),
      "trainer_devices": sorted(d.id for d in tleaf.sharding.device_set),
      "decode_state_devices": sorted(d.id for d in worker.state.lengths.sharding.device_set),
      "overlap_s": overlap, "generate_steps_during_training": gens_during_train,
      "generate_steps": len(gen_intervals), "versions_seen": sorted(versions_seen),
      "engine_version": worker.version, "store_version": store.version,
      "worker_error": repr(worker.error)}))


if __name__ == "__main__":
  sys.exit(main())
