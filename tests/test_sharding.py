"""Sharded and multi-host training (issue 6).

In-process (one CPU device): mesh construction from config, logical-axis rules -> partition
specs (hand-worked), micro-batch planning and gradient accumulation (same loss, gradients and
updated params as one pass).

Subprocesses (``--xla_force_host_platform_device_count``): for data=8, fsdp=8 (with 2
micro-batches) and fsdp=2 x tensor=2 x expert=2 (a minimal MoE model, ``sharding_helpers``), one
policy and one critic step match the single-device step and each device holds ~1/N of the
sharded params and optimizer state; steps compile once; an orbax checkpoint saved on 8 devices
(fsdp=8) restores on 4 (fsdp=2 x tensor=2) and on 1 and continues with the same losses; two
``jax.distributed`` processes (gloo) run 3 SAO steps and match the single-process
``SAOTrainer``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import portpicker
import pytest
from jax.sharding import PartitionSpec as P

from sao_jax.train import distributed, optim, sharding, steps
from sao_jax.train.sao import SAOTrainer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sharding_helpers as H  # noqa: E402  pylint: disable=wrong-import-position

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")
TOL = 1e-5


def _env(devices: int) -> dict:
  return dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
              TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu")


def _run(args, devices, timeout=600):
  proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=_env(devices),
                        capture_output=True, text=True, timeout=timeout, check=False)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  return proc


# ---- in-process: mesh, rules, specs ------------------------------------------------------------

class _FakeMesh:
  """Only ``.shape`` is read by ``logical_to_spec``."""

  def __init__(self, **shape):
    self.shape = shape


def test_logical_to_spec_hand_worked():
  moe = _FakeMesh(data=1, fsdp=2, tensor=2, expert=2)
  # expert kernel [E, D, F]: expert dim takes "expert", so "embed" falls back to fsdp alone
  assert sharding.logical_to_spec(("expert", "embed", "mlp"), (4, 64, 128), moe) == \
      P("expert", "fsdp", "tensor")
  # dense kernel [D, F]: embed over fsdp and expert (4 ways), mlp over tensor
  assert sharding.logical_to_spec(("embed", "mlp"), (64, 128), moe) == \
      P(("fsdp", "expert"), "tensor")
  # a vocab of 63 is not divisible by tensor=2: replicated along it
  assert sharding.logical_to_spec(("vocab", "embed"), (63, 64), moe) == \
      P(None, ("fsdp", "expert"))
  # embed 6 on fsdp=2 x expert=2: fsdp divides 6, fsdp*expert=4 does not
  assert sharding.logical_to_spec(("embed",), (6,), moe) == P("fsdp")
  # size-1 axes are never named; norms are replicated
  assert sharding.logical_to_spec(("embed", "heads"), (64, 64), _FakeMesh(data=8)) == P()
  assert sharding.logical_to_spec(("norm",), (64,), moe) == P()
  with pytest.raises(ValueError, match="mesh.rules"):
    sharding.logical_to_spec(("nonsense",), (4,), moe)


def test_logical_axes_from_paths():
  assert sharding.logical_axes("layers/0/attn/k_proj/kernel", 2) == ("embed", "kv_heads")
  assert sharding.logical_axes("backbone/layers/1/mlp/down_proj/kernel", 2) == ("mlp", "embed")
  assert sharding.logical_axes("layers/0/moe/gate_proj", 3) == ("expert", "embed", "mlp")
  assert sharding.logical_axes("final_norm/scale", 1) == (None,)
  with pytest.raises(ValueError, match="mesh.param_axes"):
    sharding.logical_axes("layers/0/new_layer/kernel", 2)
  with pytest.raises(ValueError, match="rank 3"):
    sharding.logical_axes("layers/0/attn/q_proj/kernel", 3)


def test_make_mesh_from_config():
  mesh = sharding.make_mesh({"fsdp": -1, "data": 1})
  assert mesh.axis_names == ("data", "fsdp") and mesh.devices.size == jax.device_count()
  assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
  with pytest.raises(ValueError, match="mesh.shape"):
    sharding.make_mesh({"data": 2 * jax.device_count()})
  with pytest.raises(ValueError, match="more than one -1"):
    sharding.make_mesh({"data": -1, "fsdp": -1})


def test_microbatch_plan_and_padding():
  # 128 trajectories of 1024 tokens, 4096 padded tokens per device per micro-batch
  assert distributed.microbatch_plan(128, 1024, 4096, batch_shards=8) == (128, 4)
  assert distributed.microbatch_plan(128, 1024, 4096, batch_shards=1) == (128, 32)
  # 100 rows on 8 shards, budget of 2 rows per device: 16 rows a micro-batch, 7 of them
  assert distributed.microbatch_plan(100, 512, 1024, batch_shards=8) == (112, 7)
  assert distributed.microbatch_plan(100, 512, 0, batch_shards=8) == (104, 1)
  b = {"tokens": np.ones((3, 4), np.int32), "policy_version": np.zeros((3, 4), np.int32),
       "action_mask": np.ones((3, 4), np.float32)}
  padded = distributed.pad_rows(b, 5, pad_id=7)
  assert padded["tokens"][3:].tolist() == [[7] * 4] * 2
  assert padded["policy_version"][3:].min() == -1 and padded["action_mask"][3:].sum() == 0
  with pytest.raises(ValueError, match="planned"):
    distributed.pad_rows(b, 2, pad_id=0)


def test_gradient_accumulation_matches_one_pass():
  """4 micro-batches (with 2 empty padding rows) give the one-pass loss, metrics and params."""
  pg, pp, cg, cp = H.make_models()
  host = H.make_batch(pg, pp, rows=14)
  batch = {k: jnp.asarray(v) for k, v in distributed.pad_rows(host, 16, pad_id=0).items()}
  batch.update(steps.make_advantage_fn(cg, gamma=1.0, lam_policy="adaptive")(cp, batch))
  ptx = optim.make_optimizer(pp, lr=1e-4)
  ctx = optim.make_optimizer(cp, lr=1e-4, frozen_patterns=(r"/attn/",))
  copy = lambda t: jax.tree.map(jnp.copy, t)
  results = {}
  for m in (1, 4):
    pol = steps.make_policy_step(pg, ptx, eps_low=0.3, eps_high=5.0, microbatches=m)
    cri = steps.make_critic_step(cg, ctx, microbatches=m)
    results[m] = (pol(steps.TrainState.create(copy(pp), ptx), batch),
                  cri(steps.TrainState.create(copy(cp), ctx), batch))
  (p1, pm1), (c1, cm1) = results[1]
  (p4, pm4), (c4, cm4) = results[4]
  for key in ("policy_loss", "masked_fraction", "ratio_max", "ratio_mean", "policy_grad_norm"):
    np.testing.assert_allclose(pm4[key], pm1[key], rtol=1e-5, atol=1e-6, err_msg=key)
  for key in ("value_loss", "value_mean", "return_mean", "critic_grad_norm"):
    np.testing.assert_allclose(cm4[key], cm1[key], rtol=1e-5, atol=1e-6, err_msg=key)
  assert float(pm1["masked_fraction"]) > 0  # the batch exercises the DIS mask
  assert H.max_abs_diff(p4.opt_state, p1.opt_state) < 1e-7  # raw gradient moments
  assert H.max_abs_diff(p4.params, p1.params) <= TOL
  assert H.max_abs_diff(c4.params, c1.params) <= TOL
  with pytest.raises(ValueError, match="microbatches=3"):
    steps.split_microbatches(batch, 3)


# ---- subprocesses: 8 devices -------------------------------------------------------------------

@pytest.fixture(scope="module")
def eight_devices(tmp_path_factory):
  """One 8-device subprocess: the three layouts, then the fsdp=8 run that saves a checkpoint."""
  d = tmp_path_factory.mktemp("eight")
  _run([os.path.join(TESTS, "sharding_worker.py"), "layouts", str(d / "layouts.json"),
        str(d / "ck"), str(d / "save.json")], devices=8)
  return d


@pytest.fixture(scope="module")
def layouts(eight_devices):
  return {r["layout"]: r for r in json.load(open(eight_devices / "layouts.json"))}


@pytest.mark.parametrize("layout", ["data=8", "fsdp=8 (2 micro-batches)",
                                    "fsdp=2 x tensor=2 x expert=2 (MoE)"])
def test_sharded_steps_match_single_device(layouts, layout):
  r = layouts[layout]
  assert r["devices"] == 8
  assert abs(r["policy_loss"] - r["policy_loss_ref"]) <= TOL
  assert abs(r["value_loss"] - r["value_loss_ref"]) <= TOL
  assert r["masked_fraction"] == pytest.approx(r["masked_fraction_ref"], abs=1e-7)
  assert r["grad_norm"] == pytest.approx(r["grad_norm_ref"], rel=1e-5)
  assert r["critic_grad_norm"] == pytest.approx(r["critic_grad_norm_ref"], rel=1e-5)
  assert r["advantages_diff"] <= TOL
  # the update moved the params by ~lr, and sharded == single device within 1e-5
  assert r["policy_update_max"] > 5e-4
  for key in ("policy_params_diff", "critic_params_diff", "policy_opt_diff", "critic_opt_diff"):
    assert r[key] <= TOL, (key, r[key])
  # no recompilation over 3 steps (2 more on new data)
  assert r["compiles"] == {"policy": 1, "critic": 1, "advantages": 1}


@pytest.mark.parametrize("layout", ["fsdp=8 (2 micro-batches)",
                                    "fsdp=2 x tensor=2 x expert=2 (MoE)"])
def test_each_device_holds_an_eighth(layouts, layout):
  """Max bytes on one device / bytes of one full copy, from ``addressable_shards``. Norm scales,
  biases and the value head stay replicated, hence a little above 1/8."""
  r = layouts[layout]
  for key in ("policy_params_fraction", "policy_opt_fraction", "critic_params_fraction",
              "critic_opt_fraction"):
    assert 0.125 <= r[key] < 0.135, (key, r[key])


def test_data_parallel_replicates(layouts):
  r = layouts["data=8"]
  assert r["policy_params_fraction"] == 1.0 and r["policy_opt_fraction"] == 1.0


def test_moe_experts_sharded_over_expert_fsdp_tensor(layouts):
  assert layouts["fsdp=2 x tensor=2 x expert=2 (MoE)"]["expert_spec"] == \
      "P('expert', 'fsdp', 'tensor')"


def test_checkpoint_restores_into_other_meshes(eight_devices, tmp_path):
  """Saved on 8 devices as fsdp=8 after 2 SAO steps; restored on 4 (fsdp=2 x tensor=2) and on
  1 device, the next 2 steps give the losses and params of the run that kept going on 8."""
  ck = str(eight_devices / "ck")
  saved = json.load(open(eight_devices / "save.json"))
  procs = {}
  for devices, shape in ((4, '{"fsdp": 2, "tensor": 2}'), (1, '{"fsdp": -1}')):
    out = tmp_path / f"restore{devices}.json"
    procs[devices] = (subprocess.Popen(
        [sys.executable, os.path.join(TESTS, "sharding_worker.py"), "restore", ck, shape,
         str(out)], cwd=ROOT, env=_env(devices), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True), out)
  for devices, (proc, out) in procs.items():
    log, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, log[-3000:]
    r = json.load(open(out))
    assert r["devices"] == devices and r["restored_step"] == 2
    assert r["spec"] == ("P('fsdp', 'tensor')" if devices == 4 else "P()")
    np.testing.assert_allclose(r["losses"], saved["losses"], atol=TOL, rtol=0)
    np.testing.assert_allclose(r["params"], saved["params"], atol=TOL, rtol=0)


# ---- two processes with jax.distributed --------------------------------------------------------

def test_two_processes_match_one(tmp_path):
  port = portpicker.pick_unused_port()
  out = tmp_path / "out.npz"
  env = _env(2)
  procs = [subprocess.Popen([sys.executable, os.path.join(TESTS, "multihost_worker.py"), str(i),
                             str(port), str(tmp_path / "ck"), str(out)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for i in range(2)]
  logs = []
  try:
    for p in procs:
      logs.append(p.communicate(timeout=600)[0])
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  for p, log in zip(procs, logs):
    assert p.returncode == 0, log[-3000:]
  assert "rows [0, 1, 2, 3, 4, 5, 6, 7]" in logs[0] and "rows [8, 9, 10" in logs[1]
  got = np.load(out)
  assert bool(got["restored_equal"])
  assert got["compiles"].tolist() == [1, 1, 1, 1]

  # one process, one device, the plain SAOTrainer on the same global batches
  SAO_CFG, STEPS, flat = H.SAO_CFG, H.STEPS, H.flat
  pg, pp, cg, cp = H.make_models()
  copy = lambda t: jax.tree.map(jnp.copy, t)  # SAOTrainer's steps donate the params
  ref = SAOTrainer(SAO_CFG, pg, copy(pp), cg, copy(cp), pad_id=0)
  losses = []
  for s in range(STEPS):
    m = ref.step(H.make_trajectories(H.make_batch(pg, pp, rows=16, seed=20 + s, version=s)),
                 policy_version=s)
    losses.append([m["policy_loss"], m["value_loss"]])
  np.testing.assert_allclose(got["losses"], losses, atol=TOL, rtol=0)
  expected = {**flat(ref.policy.params, "policy"), **flat(ref.critic.params, "critic")}
  assert len(expected) > 20
  for k, v in expected.items():
    np.testing.assert_allclose(got[k], v, atol=TOL, rtol=0, err_msg=k)
  assert np.abs(expected["policy/embed/embedding"] - np.asarray(pp["embed"]["embedding"])).max() \
      > 2e-5  # 3 steps really moved the params
