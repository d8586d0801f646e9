"""Subprocess worker of tests/test_sharding.py (needs XLA_FLAGS set before JAX starts).

``python tests/sharding_worker.py layouts OUT.json [DIR SAVE.json]``: for each mesh layout, one
policy step and one critic step sharded vs on one device; writes losses, max abs diffs,
per-device byte fractions and compile counts (then, with DIR, the ``save`` run below in the same process).

``python tests/sharding_worker.py save DIR OUT.json`` (8 devices, fsdp=8): 2 steps, orbax save,
then 2 more steps, recording their losses. ``python tests/sharding_worker.py restore DIR
'{"fsdp": 2, "tensor": 2}' OUT.json``: restore into that mesh and run the same 2 steps.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from sao_jax.train import distributed, optim, sharding, steps  # noqa: E402
from sao_jax.train.checkpoint import Checkpointer  # noqa: E402
from sao_jax.train.sao import SAOConfig  # noqa: E402
import sharding_helpers as H  # noqa: E402

EPS_LOW, EPS_HIGH = 0.3, 5.0


def _txs(pp, cp):
  """AdamW at lr 1e-3 with eps 1e-5: with the default eps 1e-8 Adam's first step
  g / (|g| + eps) turns float32 reduction-order noise on near-zero gradients (|g| ~ 1e-8) into
  parameter differences of up to ~lr; eps 1e-5 keeps the comparison about the sharding."""
  ptx = optim.make_optimizer(pp, lr=1e-3, max_grad_norm=1.0, eps=1e-5)
  ctx = optim.make_optimizer(cp, lr=1e-3, max_grad_norm=1.0, eps=1e-5,
                             frozen_patterns=(r"/attn/",))
  return ptx, ctx


def _critic_batch(cg, cp, batch):
  adv = steps.make_advantage_fn(cg, gamma=1.0, lam_policy="adaptive")(cp, batch)
  return dict(batch, **adv)


def _fractions(tree, n_devices):
  per_dev = sharding.bytes_per_device(tree)
  total = sharding.total_bytes(tree)
  assert len(per_dev) == n_devices, (len(per_dev), n_devices)
  return max(per_dev.values()) / total


_REFERENCE = {}


def reference(moe):
  """Single-device reference (no shardings, no micro-batches), computed once per model."""
  if moe not in _REFERENCE:
    pg, pp, cg, cp = H.make_models(moe=moe)
    ptx, ctx = _txs(pp, cp)
    host = H.make_batch(pg, pp, rows=16)
    batch = _critic_batch(cg, cp, {k: jnp.asarray(v) for k, v in host.items()})
    pol_ref = steps.make_policy_step(pg, ptx, eps_low=EPS_LOW, eps_high=EPS_HIGH)
    cri_ref = steps.make_critic_step(cg, ctx)
    copy = lambda t: jax.tree.map(jnp.copy, t)  # the steps donate their state
    p_ref, pm_ref = pol_ref(steps.TrainState.create(copy(pp), ptx), batch)
    c_ref, cm_ref = cri_ref(steps.TrainState.create(copy(cp), ctx), batch)
    _REFERENCE[moe] = (batch, p_ref, pm_ref, c_ref, cm_ref)
  return _REFERENCE[moe]


def run_layout(name, shape, moe, microbatches):
  pg, pp, cg, cp = H.make_models(moe=moe)
  ptx, ctx = _txs(pp, cp)
  host = H.make_batch(pg, pp, rows=16)
  host2 = H.make_batch(pg, pp, rows=16, seed=1)
  batch, p_ref, pm_ref, c_ref, cm_ref = reference(moe)

  mesh = sharding.make_mesh(shape)
  psh = sharding.make_step_shardings(mesh, pp, ptx)
  csh = sharding.make_step_shardings(mesh, cp, ctx)
  create = lambda p, tx, sh: jax.jit(lambda q: steps.TrainState.create(q, tx),
                                     out_shardings=sh.state)(distributed.put_global(p, sh.params))
  p_state, c_state = create(pp, ptx, psh), create(cp, ctx, csh)
  adv = steps.make_advantage_fn(cg, gamma=1.0, lam_policy="adaptive", shardings=csh)
  pol = steps.make_policy_step(pg, ptx, eps_low=EPS_LOW, eps_high=EPS_HIGH, shardings=psh,
                               microbatches=microbatches)
  cri = steps.make_critic_step(cg, ctx, shardings=csh, microbatches=microbatches)
  sb = jax.device_put(host, psh.batch)
  sb = dict(sb, **adv(c_state.params, sb))
  p_state, pm = pol(p_state, sb)
  c_state, cm = cri(c_state, sb)
  out = {
      "layout": name, "devices": int(mesh.size), "microbatches": microbatches,
      "policy_loss": float(pm["policy_loss"]), "policy_loss_ref": float(pm_ref["policy_loss"]),
      "value_loss": float(cm["value_loss"]), "value_loss_ref": float(cm_ref["value_loss"]),
      "masked_fraction": float(pm["masked_fraction"]),
      "masked_fraction_ref": float(pm_ref["masked_fraction"]),
      "grad_norm": float(pm["policy_grad_norm"]), "grad_norm_ref": float(pm_ref["policy_grad_norm"]),
      "critic_grad_norm": float(cm["critic_grad_norm"]),
      "critic_grad_norm_ref": float(cm_ref["critic_grad_norm"]),
      "advantages_diff": H.max_abs_diff(sb["advantages"], batch["advantages"]),
      "policy_params_diff": H.max_abs_diff(p_state.params, p_ref.params),
      "policy_opt_diff": H.max_abs_diff(p_state.opt_state, p_ref.opt_state),
      "critic_params_diff": H.max_abs_diff(c_state.params, c_ref.params),
      "critic_opt_diff": H.max_abs_diff(c_state.opt_state, c_ref.opt_state),
      "policy_update_max": H.max_abs_diff(p_ref.params, pp),
      "policy_params_fraction": _fractions(p_state.params, mesh.size),
      "policy_opt_fraction": _fractions(p_state.opt_state, mesh.size),
      "critic_params_fraction": _fractions(c_state.params, mesh.size),
      "critic_opt_fraction": _fractions(c_state.opt_state, mesh.size),
      "expert_spec": (str(psh.params["layers"][0]["moe"]["gate_proj"].spec) if moe else ""),
  }
  # more steps on new data: no recompilation
  sb2 = jax.device_put(host2, psh.batch)
  sb2 = dict(sb2, **adv(c_state.params, sb2))
  for _ in range(2):
    p_state, _ = pol(p_state, sb2)
    c_state, _ = cri(c_state, sb2)
  out["compiles"] = {"policy": pol._cache_size(), "critic": cri._cache_size(),  # pylint: disable=protected-access
                     "advantages": adv._cache_size()}  # pylint: disable=protected-access
  return out


def layouts(out_path):
  assert jax.device_count() == 8, jax.devices()
  res = [run_layout("data=8", {"data": 8}, False, 1),
         run_layout("fsdp=8 (2 micro-batches)", {"fsdp": 8}, False, 2),
         run_layout("fsdp=2 x tensor=2 x expert=2 (MoE)",
                    {"fsdp": 2, "tensor": 2, "expert": 2}, True, 1)]
  json.dump(res, open(out_path, "w"), indent=1)


SAO_CFG = SAOConfig(policy_lr=1e-3, critic_lr=1e-3, critic_lr_warmup_steps=0, batch_length=32)


def _trainer(shape):
  pg, pp, cg, cp = H.make_models()
  mesh = sharding.make_mesh(shape)
  return pg, pp, distributed.ShardedSAOTrainer(SAO_CFG, pg, pp, cg, cp, pad_id=0, mesh=mesh,
                                               batch_size=16)


def _run_steps(trainer, pg, pp, seeds, first_version):
  losses = []
  for i, s in enumerate(seeds):
    host = H.make_batch(pg, pp, rows=16, seed=s, version=first_version + i)
    m = trainer.step_on_batch(trainer.global_batch({k: v[trainer.local_rows()]
                                                    for k, v in host.items()}),
                              first_version + i)
    losses.append([m["policy_loss"], m["value_loss"]])
  return losses


def save(ckpt_dir, out_path):
  pg, pp, tr = _trainer({"fsdp": 8})
  _run_steps(tr, pg, pp, [10, 11], 0)
  ck = Checkpointer(ckpt_dir)
  ck.save(2, {"policy": tr.policy, "critic": tr.critic})
  ck.close()
  after = _run_steps(tr, pg, pp, [12, 13], 2)
  json.dump({"losses": after, "params": np.asarray(tr.policy.params["embed"]["embedding"]).tolist()},
            open(out_path, "w"))


def restore(ckpt_dir, shape_json, out_path):
  pg, pp, tr = _trainer(json.loads(shape_json))
  target = {"policy": sharding.abstract_like(tr.policy, tr.policy_sh.state),
            "critic": sharding.abstract_like(tr.critic, tr.critic_sh.state)}
  ck = Checkpointer(ckpt_dir)
  state = ck.restore(target)
  ck.close()
  tr.policy, tr.critic = state["policy"], state["critic"]
  restored_step = int(tr.policy.step)
  spec = str(tr.policy.params["layers"][0]["mlp"]["gate_proj"]["kernel"].sharding.spec)
  after = _run_steps(tr, pg, pp, [12, 13], 2)
  json.dump({"losses": after, "devices": jax.device_count(), "spec": spec,
             "restored_step": restored_step,
             "params": np.asarray(tr.policy.params["embed"]["embedding"]).tolist()},
            open(out_path, "w"))


if __name__ == "__main__":
  mode = sys.argv[1]
  if mode == "layouts":  # layouts OUT.json [CKPT_DIR SAVE.json]
    layouts(sys.argv[2])
    if len(sys.argv) > 3:
      save(sys.argv[3], sys.argv[4])
  elif mode == "save":
    save(sys.argv[2], sys.argv[3])
  elif mode == "restore":
    restore(sys.argv[2], sys.argv[3], sys.argv[4])
  else:
    raise SystemExit(f"unknown mode {mode}")
