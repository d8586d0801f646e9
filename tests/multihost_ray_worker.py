"""One trainer process of the two-process ``jax.distributed`` + Ray test
(tests/integration/test_ray_source.py).

``python tests/multihost_ray_worker.py PROCESS_ID PORT RAY_ADDRESS OUT_DIR``: joins a 2-process
CPU cluster (gloo, 2 local devices each -> mesh data=2 x fsdp=2), joins the test's Ray cluster,
feeds its own rows from its own Ray rollout actor (``RaySource``, one actor per process, its own
ledger), runs 3 SAO steps publishing the weights after each, saves and restores an orbax
checkpoint collectively, and writes the trajectories it trained on, the losses and (process 0)
the final params, the learner's compile counts and whether the restore equals them to OUT_DIR;
it prints the sockets it listens on while gloo is connected.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from sao_jax import build, pretrained, roles, tasks  # noqa: E402
from sao_jax.models.transformer import Transformer  # noqa: E402
from sao_jax.rollout.ledger import PromptLedger  # noqa: E402
from sao_jax.rollout.ray_local import init_ray  # noqa: E402
from sao_jax.rollout.ray_source import RaySource  # noqa: E402
from sao_jax.train import distributed, sharding  # noqa: E402
from sao_jax.train.checkpoint import Checkpointer  # noqa: E402
from sao_jax.train.learner import Learner, LearnerConfig  # noqa: E402
import sharding_helpers as H  # noqa: E402

STEPS, LOCAL_BATCH = 3, 4
FIELDS = ("tokens", "action_mask", "logprobs", "policy_version")


def config():
  """``configs/arith_tool.py:smoke`` with a tiny model (the actors build the same structure)."""
  c = H.arith_config()
  c.task.n_train, c.task.n_eval = 64, 2
  c.model.d_model, c.model.n_layers, c.model.n_heads, c.model.n_kv_heads = 32, 1, 2, 1
  c.model.head_dim, c.model.d_ff, c.model.max_seq_len = 16, 64, 64
  c.rollout.slots, c.rollout.max_new_tokens = 4, 8
  c.train.policy_lr = c.train.critic_lr = 1e-5
  c.train.critic_lr_warmup_steps, c.train.batch_size = 0, 2 * LOCAL_BATCH
  c.rollout.backend, c.rollout.num_workers, c.rollout.ray_num_cpus = "ray", 1, 0.5
  c.rollout.ray_max_outstanding = 4
  return c  # a ConfigDict (the test's top); main converts it to the typed roles


def models(c):
  task = tasks.make_task(c)
  mcfg = pretrained.model_config(c.model, task.tokenizer.vocab_size)
  graphdef, params = nnx.split(Transformer(mcfg, rngs=nnx.Rngs(0)))
  params = nnx.to_pure_dict(params)
  return task, mcfg, graphdef, params, build.critic_from_policy(mcfg, params, 1)


def main(pid: int, port: int, ray_address: str, out: str) -> None:
  distributed.initialize(roles.Distributed(coordinator_address=f"localhost:{port}",
                                           num_processes=2, process_id=pid))
  assert jax.process_count() == 2 and jax.device_count() == 4
  c = config()
  c.rollout.ray_address = ray_address
  c = roles.from_config(c)
  init_ray(ray_address, log_to_driver=False)  # the test's cluster, on 127.0.0.1
  task, mcfg, graphdef, params, (cg, cp) = models(c)
  learner = Learner(LearnerConfig.from_run(c), graphdef, params, cg, cp,
                    pad_id=task.tokenizer.pad_id, vocab_size=mcfg.vocab_size,
                    mesh=sharding.make_mesh({"data": 2, "fsdp": -1}))
  source = RaySource(c, mcfg, PromptLedger(task.train_problems, c.seed + pid),
                     learner.policy_params(), 0)
  losses, saved = [], {}
  try:
    for step in range(STEPS):
      trajs = source.take(LOCAL_BATCH, step)
      m = learner.train_step(trajs, step)
      losses.append([m["policy_loss"], m["value_loss"]])
      source.publish(learner.policy_params(), step + 1)
      for i, t in enumerate(trajs):
        for f in FIELDS:
          saved[f"s{step}_r{i}_{f}"] = np.asarray(getattr(t, f))
        saved[f"s{step}_r{i}_reward"] = np.float32(t.reward)
  finally:
    source.close()
  np.savez(os.path.join(out, f"trajs{pid}.npz"), losses=np.array(losses), **saved)
  ck = Checkpointer(os.path.join(out, "ck"))
  ck.save(STEPS, learner.states())
  ck.wait()
  restored = ck.restore(learner.restore_target())
  ck.close()
  gather = lambda t: multihost_utils.process_allgather(t, tiled=True)
  policy, critic = gather(learner.policy.params), gather(learner.critic.params)
  same = all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(policy),
                                                  jax.tree.leaves(gather(restored["policy"].params))))
  if distributed.is_main_process():
    np.savez(os.path.join(out, "params.npz"), **H.flat(policy, "policy"),
             **H.flat(critic, "critic"))
    np.savez(os.path.join(out, "facts.npz"), restored_equal=same,
             compiles=np.array(list(learner.compilations().values())))
  print(f"process {pid}: losses {losses} restored_equal {same}", flush=True)
  print(f"process {pid} listens on {listening()}", flush=True)  # while gloo is still connected


def listening() -> list:
  """[(ip, port), ...] this process listens on (the coordinator service on process 0, gloo's,
  the Ray driver's and any other server's sockets)."""
  import psutil  # pylint: disable=import-outside-toplevel  (installed with orbax / portpicker)
  return sorted({(c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections("inet")
                 if c.status == psutil.CONN_LISTEN})


if __name__ == "__main__":
  main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
