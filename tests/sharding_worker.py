"""Subprocess worker of tests/unit/train/test_sharding.py (XLA_FLAGS gives 8 CPU devices before JAX
starts).

With the one ``Learner``:
``python tests/sharding_worker.py modes OUT.json``: every mode (sao, vapo, grpo_async, grpo_sync)
for 3 steps with the real Qwen3-MoE model on one device, on ``fsdp=-1`` and on
``fsdp=2,tensor=2,expert=2`` (losses, params), and layout facts (bytes per device, the expert
weights' spec, compile counts).
``python tests/sharding_worker.py fields OUT.json CKPT``: each objective / estimator field set on
``fsdp=-1`` and on one device (the second step's losses, and the default setting's), then a
checkpoint saved on fsdp=8 after 2 steps, and the losses of 2 more steps.
``python tests/sharding_worker.py restore CKPT '{"fsdp": 2, "tensor": 2}' OUT.json``: restore into
that mesh and run the same 2 steps.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from sao_jax.train import modes as modes_lib, sharding  # noqa: E402
from sao_jax.train.checkpoint import Checkpointer  # noqa: E402
from sao_jax.train.learner import Learner  # noqa: E402
import sharding_helpers as H  # noqa: E402

LAYOUTS = {"one device": None, "fsdp=-1": {"fsdp": -1},
           "fsdp=2,tensor=2,expert=2": {"fsdp": 2, "tensor": 2, "expert": 2}}
# field -> (train overrides): each changes the loss away from its mode's default
FIELDS = {
    "entropy_coef": dict(entropy_coef=0.1),
    "kl_coef": dict(kl_coef=0.5),
    "aggregation": dict(aggregation="seq_mean"),
    "tis_cap": dict(objective="tis", tis_cap=0.5),
    "advantage_estimator=running_mean_prompt": dict(advantage_estimator="running_mean_prompt"),
    "value_clip_eps": dict(value_clip_eps=1e-3),
    "lam_critic": dict(lam_critic=0.5),
}
ADAM = dict(adam_eps=1e-5)  # keeps Adam from amplifying reduction-order noise on ~0 gradients


def learner(mode, shape, moe, **train):
  pg, pp, cg, cp = H.make_models(moe=moe)
  mesh = sharding.make_mesh(shape) if shape else None
  cfg = H.learner_config(mode, **{**ADAM, **train})
  return pg, pp, Learner(cfg, pg, pp, cg, cp, pad_id=0, vocab_size=64, mesh=mesh)


def run_steps(lr, pg, pp, seeds, first_version, group_size=1):
  losses = []
  for i, s in enumerate(seeds):
    trajs = H.make_trajectories(pg, pp, seed=s, version=first_version + i, group_size=group_size)
    m = lr.train_step(trajs, first_version + i)
    losses.append([m["policy_loss"], m.get("value_loss", 0.0)])
  return losses


def fraction(tree, n):
  per = H.bytes_per_device(tree)
  assert len(per) == n, (len(per), n)
  return max(per.values()) / H.total_bytes(tree)


def step_temp_bytes(shape):
  """XLA temp bytes per device of the compiled policy step and first critic update of a dense
  model whose activations outweigh its parameters (d_model 128, 16 rows x 128 tokens)."""
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from sao_jax.models import presets  # pylint: disable=import-outside-toplevel
  from sao_jax.models.transformer import Critic, Transformer  # pylint: disable=import-outside-toplevel
  from sao_jax.train.batch import Batch  # pylint: disable=import-outside-toplevel
  b, t = 16, 128
  cfg = presets.get_preset("tiny-qwen3", vocab_size=256, d_model=128, n_layers=2, head_dim=32,
                           d_ff=256, max_seq_len=t)
  pg, pp = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
  cg, cp = nnx.split(Critic(cfg, rngs=nnx.Rngs(1)))
  lr = Learner(H.learner_config("sao", batch_size=b), pg, nnx.to_pure_dict(pp), cg,
               nnx.to_pure_dict(cp), pad_id=0, vocab_size=256,
               mesh=sharding.make_mesh(shape) if shape else None)
  rows = lr.batch_sharding
  z = np.zeros((b, t), np.float32)
  batch = Batch.of(z.astype(np.int32), z + 1, rollout_logprobs=z)
  batch = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rows), batch)
  adv = jax.ShapeDtypeStruct((b, t), np.float32, sharding=rows)
  _, _, policy, _, first = lr.jitted_steps(1)
  return {"policy": policy.lower(lr.policy, batch, adv, None).compile(),
          "first_critic": first.lower(lr.critic, batch).compile()}


def activation_temp_fractions():
  """Per-device temp bytes of each layout's steps / one device's (activations sharded on the
  batch: about 1 / the batch shards)."""
  one = {k: c.memory_analysis().temp_size_in_bytes for k, c in step_temp_bytes(None).items()}
  return {name: {k: c.memory_analysis().temp_size_in_bytes / one[k]
                 for k, c in step_temp_bytes(shape).items()}
          for name, shape in LAYOUTS.items() if shape}


# grpo_sync's learner is grpo_async's (their ModeSpecs differ only in ``synchronous``, the
# trajectory source's barrier; the learner never reads it): one of them runs on the meshes
LEARNER_MODES = tuple(m for m in modes_lib.MODES if m != "grpo_sync")


def modes_and_layouts():
  out, facts = {}, {}
  for mode in LEARNER_MODES:
    g = 4 if mode.startswith("grpo") else 1
    for name, shape in LAYOUTS.items():
      pg, pp, lr = learner(mode, shape, True)
      losses = run_steps(lr, pg, pp, [20, 21, 22], 0, group_size=g)
      params = H.flat(jax.device_get(lr.policy.params), "policy")
      if lr.uses_critic:
        params.update(H.flat(jax.device_get(lr.critic.params), "critic"))
      out[(mode, name)] = (losses, params)
      if mode == "sao" and shape:
        n = lr.mesh.size
        facts[name] = {
            "devices": int(n), "compiles": lr.compilations(),
            "policy_params_fraction": fraction(lr.policy.params, n),
            "policy_opt_fraction": fraction(lr.policy.opt_state, n),
            "critic_params_fraction": fraction(lr.critic.params, n),
            "critic_opt_fraction": fraction(lr.critic.opt_state, n),
            "expert_spec": str(lr.policy_sh.params["layers"][0]["mlp"]["gate_proj"].spec)}
  for name, fr in activation_temp_fractions().items():
    facts[name]["temp_fraction"] = fr
  res = {}
  for mode in LEARNER_MODES:
    ref_losses, ref_params = out[(mode, "one device")]
    for name in LAYOUTS:
      losses, params = out[(mode, name)]
      res[f"{mode} / {name}"] = {
          "losses": losses, "losses_ref": ref_losses,
          "params_diff": max(float(np.abs(params[k] - ref_params[k]).max()) for k in params),
          "params_moved": max(float(np.abs(params[k] - v).max()) for k, v in
                              H.flat(H.make_models(moe=True)[1], "policy").items())}
  return res, facts


def fields():
  res, base = {}, None
  for key, train in [("default", {}), *FIELDS.items()]:
    row = {}
    for name in ("one device", "fsdp=-1"):
      pg, pp, lr = learner("sao", LAYOUTS[name], False, **train)
      trajs = H.make_trajectories(pg, pp, seed=5)
      lr.train_step(trajs, 0)  # the running-mean window fills; the next step reads it
      m = lr.train_step(H.make_trajectories(pg, pp, seed=5), 1)
      row[name] = [m["policy_loss"], m.get("value_loss", 0.0), m["advantage_mean"]]
    base = base or row["one device"]
    row["default"] = base
    res[key] = row
  return res


def save(ckpt_dir):
  pg, pp, lr = learner("sao", {"fsdp": 8}, False)
  run_steps(lr, pg, pp, [10, 11], 0)
  ck = Checkpointer(ckpt_dir)
  ck.save(2, lr.states())
  ck.close()
  after = run_steps(lr, pg, pp, [12, 13], 2)
  return {"losses": after,
          "params": np.asarray(jax.device_get(lr.policy.params["embed"]["embedding"])).tolist()}


def restore(ckpt_dir, shape_json, out_path):
  pg, pp, lr = learner("sao", json.loads(shape_json), False)
  ck = Checkpointer(ckpt_dir)
  lr.load_states(ck.restore(lr.restore_target()))
  ck.close()
  spec = str(lr.policy.params["layers"][0]["mlp"]["gate_proj"]["kernel"].sharding.spec)
  step = int(lr.policy.step)
  after = run_steps(lr, pg, pp, [12, 13], 2)
  json.dump({"losses": after, "devices": jax.device_count(), "spec": spec, "restored_step": step,
             "params": np.asarray(jax.device_get(lr.policy.params["embed"]["embedding"])).tolist()},
            open(out_path, "w"))


if __name__ == "__main__":
  if sys.argv[1] in ("modes", "fields"):
    assert jax.device_count() == 8, jax.devices()
    if sys.argv[1] == "modes":
      res, facts = modes_and_layouts()
      out = {"modes": res, "layouts": facts}
    else:
      out = {"fields": fields(), "save": save(sys.argv[3])}
    json.dump(out, open(sys.argv[2], "w"), indent=1)
  elif sys.argv[1] == "restore":
    restore(sys.argv[2], sys.argv[3], sys.argv[4])
  else:
    raise SystemExit(f"unknown mode {sys.argv[1]}")
