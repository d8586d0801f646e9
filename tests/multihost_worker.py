"""One process of the two-process ``jax.distributed`` test (tests/test_sharding.py).

``python tests/multihost_worker.py PROCESS_ID PORT CKPT_DIR OUT.npz``: joins a 2-process CPU
cluster (gloo collectives, 2 local devices each -> a 4-device mesh data=2 x fsdp=2), runs 3 SAO
steps feeding only this process's trajectories, saves and restores an orbax checkpoint
collectively, and (process 0) writes the final policy/critic params and per-step losses.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from sao_jax import roles  # noqa: E402
from sao_jax.train import distributed, sharding  # noqa: E402
from sao_jax.train.checkpoint import Checkpointer  # noqa: E402
from sao_jax.train.distributed import process_rows  # noqa: E402
from sao_jax.train.learner import Learner  # noqa: E402
import sharding_helpers as H  # noqa: E402
from sharding_helpers import STEPS, flat  # noqa: E402


def main(pid: int, port: int, ckpt_dir: str, out: str) -> None:
  distributed.initialize(roles.Distributed(coordinator_address=f"localhost:{port}",
                                           num_processes=2, process_id=pid))
  assert jax.process_count() == 2 and jax.device_count() == 4 and jax.local_device_count() == 2
  pg, pp, cg, cp = H.make_models()
  mesh = sharding.make_mesh({"data": 2, "fsdp": -1})
  tr = Learner(H.learner_config("sao", policy_lr=1e-5, critic_lr=1e-5), pg, pp, cg, cp,
               pad_id=0, vocab_size=64, mesh=mesh)
  rows = process_rows(tr.batch_sharding, 16)
  losses = []
  for s in range(STEPS):
    trajs = H.make_trajectories(pg, pp, seed=20 + s, version=s)
    m = tr.train_step([trajs[i] for i in rows], policy_version=s)
    losses.append([m["policy_loss"], m["value_loss"]])
  ck = Checkpointer(ckpt_dir)
  ck.save(STEPS, tr.states())
  ck.wait()
  restored = ck.restore(tr.restore_target())
  ck.close()
  gather = lambda t: multihost_utils.process_allgather(t, tiled=True)
  policy, critic = gather(tr.policy.params), gather(tr.critic.params)
  r_policy = gather(restored["policy"].params)
  same = all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(policy),
                                                  jax.tree.leaves(r_policy)))
  if distributed.is_main_process():
    np.savez(out, losses=np.array(losses), rows=rows, restored_equal=same,
             compiles=np.array(list(tr.compilations().values())),
             **flat(policy, "policy"), **flat(critic, "critic"))
  print(f"process {pid}: rows {rows.tolist()} losses {losses} restored_equal {same}", flush=True)
  print(f"process {pid} listens on {listening()}", flush=True)  # while gloo is still connected


def listening() -> list:
  """[(ip, port), ...] this process listens on (the coordinator service on process 0, gloo's
  and any other server's sockets)."""
  import psutil  # pylint: disable=import-outside-toplevel  (installed with orbax / portpicker)
  return sorted({(c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections("inet")
                 if c.status == psutil.CONN_LISTEN})


if __name__ == "__main__":
  main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
