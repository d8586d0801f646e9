"""One learner on any mesh (issue 14).

In-process (one CPU device): logical-axis rules -> partition specs (hand-worked), the model's
one parameter-axis table, mesh construction from config, micro-batch planning, and gradient
accumulation inside the learner (same losses and params as one pass).

Subprocesses (``--xla_force_host_platform_device_count=8``), two at once:
  * every mode (sao, vapo, grpo_async, grpo_sync) runs 3 steps of the real Qwen3-MoE model of
    ``sao_jax.models`` on one device, on ``fsdp=-1`` and on ``fsdp=2,tensor=2,expert=2``:
    losses within 1e-5 and params within 1e-5 of the one-device run (seen: <= 6.3e-7 for both,
    while 3 steps move params by 3e-3); each device holds ~1/8 of params and optimizer state;
    the steps compile once;
  * every objective / estimator field set on ``fsdp=-1`` changes the loss exactly as it does on
    one device; an orbax checkpoint saved on fsdp=8 restores on 4 devices and on 1 and goes on
    with the same losses;
  * (two ``jax.distributed`` processes (gloo) equal to one process, with a collective orbax
    checkpoint: ``test_two_trainer_processes_with_ray_actors_equal_one_process`` in
    ``tests/integration/test_ray_source.py``, where each process is fed by its own Ray rollout
    actor.)
"""

from __future__ import annotations

import repo_paths  # tests/repo_paths.py
import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from sao_jax.models import partition
from sao_jax.rollout.ray_local import is_loopback
from sao_jax.train import distributed, sharding, steps
from sao_jax.train.batch import Batch, BatchError, build_batch
from sao_jax.train.learner import Learner

import sharding_helpers as H  # noqa: E402  pylint: disable=wrong-import-position
from conftest import with_test_xla_flags  # noqa: E402  pylint: disable=wrong-import-position

ROOT = repo_paths.ROOT
TESTS = os.path.join(ROOT, "tests")
TOL = 1e-5


def _env(devices: int) -> dict:
  return dict(os.environ, XLA_FLAGS=with_test_xla_flags(
      f"--xla_force_host_platform_device_count={devices}"),
              TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu")


def _popen(args, devices):
  return subprocess.Popen([sys.executable, *args], cwd=ROOT, env=_env(devices),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait(proc, timeout=1200):
  log, _ = proc.communicate(timeout=timeout)
  assert proc.returncode == 0, log[-3000:]
  return log


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
  with pytest.raises(ValueError, match="LOGICAL_RULES"):
    sharding.logical_to_spec(("nonsense",), (4,), moe)


def test_logical_axes_from_the_models_table():
  assert partition.axes_for_path("layers/0/attn/k_proj/kernel", 2) == ("embed", "kv_heads")
  assert partition.axes_for_path("backbone/layers/1/mlp/down_proj/kernel", 2) == ("mlp", "embed")
  assert partition.axes_for_path("layers/0/mlp/gate_proj", 3) == ("expert", "embed", "mlp")
  assert partition.axes_for_path("layers/0/mlp/router/kernel", 2) == ("embed", "expert")
  assert partition.axes_for_path("final_norm/scale", 1) == ("norm",)
  with pytest.raises(ValueError, match="sao_jax/models/partition.py"):
    partition.axes_for_path("layers/0/new_layer/kernel", 2)
  with pytest.raises(ValueError, match="rank 3"):
    partition.axes_for_path("layers/0/attn/q_proj/kernel", 3)
  # the real MoE model: every parameter has a spec on the 3-axis mesh (the old train-side table
  # raised on layers/*/mlp/{gate,up,down}_proj)
  specs = sharding.param_specs(H.make_models(moe=True)[1], _FakeMesh(fsdp=2, tensor=2, expert=2))
  mlp = specs["layers"][0]["mlp"]
  assert mlp["gate_proj"] == P("expert", "fsdp", "tensor")
  assert mlp["down_proj"] == P("expert", "tensor", "fsdp")
  # router [D, E]: embed takes fsdp and expert first, so the expert dim is replicated
  assert mlp["router"]["kernel"] == P(("fsdp", "expert"))


def test_make_mesh_from_config():
  mesh = sharding.make_mesh({"fsdp": -1, "data": 1})
  assert mesh.axis_names == ("data", "fsdp") and mesh.devices.size == jax.device_count()
  assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
  with pytest.raises(ValueError, match="mesh.shape"):
    sharding.make_mesh({"data": 2 * jax.device_count()})
  with pytest.raises(ValueError, match="more than one -1"):
    sharding.make_mesh({"data": -1, "fsdp": -1})


def test_microbatch_plan():
  # 128 trajectories of 1024 tokens, 4096 padded tokens per device per micro-batch
  assert distributed.microbatch_plan(128, 1024, 4096, batch_shards=8) == (128, 4)
  assert distributed.microbatch_plan(128, 1024, 4096, batch_shards=1) == (128, 32)
  # 100 rows on 8 shards, budget of 2 rows per device: 16 rows a micro-batch, 7 of them
  assert distributed.microbatch_plan(100, 512, 1024, batch_shards=8) == (112, 7)
  assert distributed.microbatch_plan(100, 512, 0, batch_shards=8) == (104, 1)


@pytest.mark.slow
def test_gradient_accumulation_in_the_learner_matches_one_pass():
  """mesh.tokens_per_device = 4 rows of 32 tokens: 14 trajectories become 4 micro-batches of 4
  rows (2 empty padding rows) with the one-pass losses, metrics and params."""
  pg, pp, cg, cp = H.make_models()
  trajs = H.make_trajectories(pg, pp, rows=14)
  out = {}
  for budget in (0, 128):
    cfg = H.learner_config("sao", adam_eps=1e-5)
    cfg = dataclasses.replace(cfg, tokens_per_device=budget)
    lr = Learner(cfg, pg, pp, cg, cp, pad_id=0, vocab_size=64)
    batch, micro = lr.batch(trajs)
    out[budget] = (micro, batch.rows, lr.step(batch, 0), lr)
  (m1, r1, met1, l1), (m4, r4, met4, l4) = out[0], out[128]
  assert (m1, r1, m4, r4) == (1, 14, 4, 16)
  for key in ("policy_loss", "masked_fraction", "ratio_max", "ratio_mean", "policy_grad_norm",
              "value_loss", "value_mean", "return_mean", "critic_grad_norm"):
    np.testing.assert_allclose(met4[key], met1[key], rtol=1e-5, atol=1e-6, err_msg=key)
  assert met1["masked_fraction"] > 0  # the batch exercises the DIS mask
  assert H.max_abs_diff(l4.policy.params, l1.policy.params) <= TOL
  assert H.max_abs_diff(l4.critic.params, l1.critic.params) <= TOL
  # the caller's params are untouched (the learner copies what it is given)
  assert H.max_abs_diff(pp, H.make_models()[1]) == 0.0


@pytest.mark.slow
def test_policy_minibatches_move_the_ratio_and_the_clip_acts():
  """PPO-family baselines (issue 16 item 4): with M = 4 mini-batch updates per batch the old
  policy is the one at the batch's start, so from the second mini-batch on the ratio leaves 1
  and the clip zeroes tokens; with M = 1 the ratio is exactly 1 and nothing is clipped. The
  policy takes M optimizer steps; the critic still K."""
  pg, pp, cg, cp = H.make_models()
  trajs = H.make_trajectories(pg, pp, rows=16)
  out = {}
  for m in (1, 4):
    lr = Learner(H.learner_config("vapo", policy_minibatches=m, policy_lr=3e-2), pg, pp, cg, cp,
                 pad_id=0, vocab_size=64)
    batch, micro = lr.batch(trajs)
    out[m] = (lr.step(batch, 0, micro), lr)
  one, four = out[1][0], out[4][0]
  assert one["ratio_min"] == one["ratio_max"] == 1.0 and one["masked_fraction"] == 0.0
  assert four["ratio_max"] > 1.28 or four["ratio_min"] < 0.8  # outside the clip band
  assert four["masked_fraction"] > 0.01  # clipped fraction (mean over the 4 mini-batches)
  assert int(out[4][1].policy.step) == 4 and int(out[1][1].policy.step) == 1
  assert int(out[4][1].critic.step) == int(out[1][1].critic.step) == 2
  with pytest.raises(ValueError, match="policy_minibatches"):
    lr = Learner(H.learner_config("vapo", policy_minibatches=3), pg, pp, cg, cp, pad_id=0,
                 vocab_size=64)
    lr.step(*lr.batch(trajs))


@pytest.mark.slow
def test_running_mean_advantages_are_reward_minus_the_window_mean():
  """The learner's running-mean estimator end to end: the first batch meets empty windows
  (advantage = reward, fraction non-empty 0); the same prompts again with the rewards flipped
  meet windows holding the first rewards, so A = r' - r (+-1) on every row, all non-empty."""
  pg, pp, _, _ = H.make_models()
  first = H.make_trajectories(pg, pp, rows=16)            # reward (i % 2), prompt p<i>
  second = H.make_trajectories(pg, pp, rows=16, seed=1)   # reward ((i + 1) % 2), same prompts
  lr = Learner(H.learner_config("sao", advantage_estimator="running_mean_prompt"), pg, pp,
               pad_id=0, vocab_size=64)
  n = np.array([t.num_action_tokens for t in first], float)
  r1 = np.array([t.reward for t in first])
  r2 = np.array([t.reward for t in second])
  m1 = lr.train_step(first, 0)
  assert m1["baseline_nonempty_fraction"] == 0.0
  np.testing.assert_allclose(m1["advantage_mean"], (n * r1).sum() / n.sum(), rtol=1e-6)
  m2 = lr.train_step(second, 1)
  assert m2["baseline_nonempty_fraction"] == 1.0
  np.testing.assert_allclose(m2["advantage_mean"], (n * (r2 - r1)).sum() / n.sum(), rtol=1e-6,
                             atol=1e-7)


def test_value_bounds_and_advantage_centring():
  """Two remedies of the value-overshoot study: ``value_bounds=(0, 1)`` clips a critic that
  overshoots (value head scaled so V reaches far outside [0, 1]) to the reward range before GAE;
  ``center_advantages`` makes the token mean of the advantages 0 (it is not 0 without it)."""
  pg, pp, cg, cp = H.make_models()
  cp["value_head"]["kernel"] = 30.0 * cp["value_head"]["kernel"]
  batch = build_batch(H.make_trajectories(pg, pp, rows=16), 0, length=H.LENGTH)
  mask = np.asarray(batch.action_mask)
  kw = dict(estimator="skip_obs_gae", gamma=1.0, lam_policy="adaptive", lam_alpha=1.5,
            lam_critic=1.0, bootstrap_truncated=False, grpo_eps=1e-6)
  free = steps.advantage_targets(cg, cp, batch, **kw)
  bounded = steps.advantage_targets(cg, cp, batch, value_bounds=(0.0, 1.0), **kw)
  centred = steps.advantage_targets(cg, cp, batch, center_advantages=True, **kw)
  v, vb = np.asarray(free["values"])[mask], np.asarray(bounded["values"])[mask]
  assert v.max() > 1.5 or v.min() < -0.5  # the critic overshoots the reward range
  assert vb.min() >= 0.0 and vb.max() <= 1.0
  np.testing.assert_allclose(vb, np.clip(v, 0.0, 1.0), atol=1e-6)
  assert abs(np.asarray(free["advantages"])[mask].mean()) > 0.05
  assert abs(np.asarray(centred["advantages"])[mask].mean()) < 1e-5
  assert np.all(np.asarray(centred["advantages"])[~mask] == 0.0)


# ---- subprocesses: 8 devices -------------------------------------------------------------------

@pytest.fixture(scope="module")
def eight_devices(tmp_path_factory):
  """The two 8-device workers, at once (2 cores): modes/layouts, and fields + checkpoint."""
  d = tmp_path_factory.mktemp("eight")
  procs = [_popen([os.path.join(TESTS, "sharding_worker.py"), "modes", str(d / "modes.json")],
                  8),
           _popen([os.path.join(TESTS, "sharding_worker.py"), "fields", str(d / "fields.json"),
                   str(d / "ck")], 8)]
  for p in procs:
    _wait(p)
  out = {}
  for name in ("modes", "fields"):
    out.update(json.load(open(d / f"{name}.json")))
  out["dir"] = d
  return out


MODES = ("sao", "vapo", "grpo_async")  # grpo_sync's learner is grpo_async's (sharding_worker.py)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["fsdp=-1", "fsdp=2,tensor=2,expert=2"])
@pytest.mark.parametrize("mode", MODES)
def test_every_mode_on_a_mesh_equals_one_device(eight_devices, mode, layout):
  """Real Qwen3-MoE (models/), 3 steps: losses and params within 1e-5 of one device."""
  r = eight_devices["modes"][f"{mode} / {layout}"]
  np.testing.assert_allclose(r["losses"], r["losses_ref"], atol=TOL, rtol=0)
  assert r["params_diff"] <= TOL, r["params_diff"]
  assert r["params_moved"] > 1e-3  # the 3 steps really moved the params


@pytest.mark.slow
def test_each_field_changes_the_loss_on_a_mesh_as_on_one_device(eight_devices):
  """policy loss, value loss and mean advantage of the second step, fsdp=-1 vs one device."""
  fields = eight_devices["fields"]
  assert len(fields) == 8
  for key, r in fields.items():
    np.testing.assert_allclose(r["fsdp=-1"], r["one device"], atol=TOL, rtol=1e-5, err_msg=key)
    if key != "default":
      changed = np.abs(np.array(r["one device"]) - np.array(r["default"])).max()
      assert changed > 1e-3, (key, changed)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["fsdp=-1", "fsdp=2,tensor=2,expert=2"])
def test_each_device_holds_an_eighth_and_compiles_once(eight_devices, layout):
  """Max bytes on one device / bytes of one full copy, from ``addressable_shards``. Norm scales,
  biases and the value head stay replicated, hence a little above 1/8."""
  r = eight_devices["layouts"][layout]
  for key in ("policy_params_fraction", "policy_opt_fraction", "critic_params_fraction",
              "critic_opt_fraction"):
    assert 0.125 <= r[key] < 0.14, (key, r[key])
  assert r["compiles"] == {"first_critic": 1, "critic": 1, "policy": 1, "metrics": 1}
  # activations sharded on the batch's mesh axes (transformer.activation_constraint): per-device
  # XLA temp of the policy step and first critic update / one device's. Measured 0.132 / 0.129
  # (fsdp=-1) and 0.155 / 0.147 (2,2,2); without the constraint 0.303 / 0.322 and 0.218 / 0.219.
  bound = {"fsdp=-1": 0.2, "fsdp=2,tensor=2,expert=2": 0.19}[layout]
  for step, fraction in r["temp_fraction"].items():
    assert fraction < bound, (step, fraction)


@pytest.mark.slow
def test_moe_experts_sharded_over_expert_fsdp_tensor(eight_devices):
  assert eight_devices["layouts"]["fsdp=2,tensor=2,expert=2"]["expert_spec"] == \
      "P('expert', 'fsdp', 'tensor')"


@pytest.mark.slow
def test_checkpoint_restores_into_other_meshes(eight_devices, tmp_path):
  """Saved on 8 devices as fsdp=8 after 2 SAO steps; restored on 4 (fsdp=2 x tensor=2) and on
  1 device, the next 2 steps give the losses and params of the run that kept going on 8."""
  ck = str(eight_devices["dir"] / "ck")
  saved = eight_devices["save"]
  procs = {}
  for devices, shape in ((4, '{"fsdp": 2, "tensor": 2}'), (1, '{"fsdp": -1}')):
    out = tmp_path / f"restore{devices}.json"
    procs[devices] = (_popen([os.path.join(TESTS, "sharding_worker.py"), "restore", ck, shape,
                              str(out)], devices), out)
  for devices, (proc, out) in procs.items():
    _wait(proc, 600)
    r = json.load(open(out))
    assert r["devices"] == devices and r["restored_step"] == 2
    assert r["spec"] == ("P('fsdp', 'tensor')" if devices == 4 else "P()")
    np.testing.assert_allclose(r["losses"], saved["losses"], atol=TOL, rtol=0)
    np.testing.assert_allclose(r["params"], saved["params"], atol=TOL, rtol=0)


# ---- two processes with jax.distributed --------------------------------------------------------

def test_loopback_hosts_and_the_coordinator_bind_address(monkeypatch):
  """A coordinator address on this machine binds loopback; any other keeps JAX's default."""
  for host in ("localhost", "127.0.0.1", "127.0.1.1", "[::1]", "::1", "::ffff:127.0.0.1"):
    assert is_loopback(host), host
  for host in ("192.0.2.2", "host0", "0.0.0.0", "::", ""):
    assert not is_loopback(host), host
  monkeypatch.delenv("JAX_COORDINATOR_BIND_ADDRESS", raising=False)
  assert distributed.bind_address("localhost:1234") == "127.0.0.1:1234"
  assert distributed.bind_address("127.0.0.1:99") == "127.0.0.1:99"
  assert distributed.bind_address("[::1]:1234") == "[::1]:1234"
  assert distributed.bind_address("host0:1234") is None
  monkeypatch.setenv("JAX_COORDINATOR_BIND_ADDRESS", "[::]:1234")  # the user's choice wins
  assert distributed.bind_address("localhost:1234") is None


def test_learner_refuses_an_empty_batch_a_bad_reward_and_an_incomplete_group():
  """Each is refused naming what is wrong, before anything is compiled or trained."""
  import dataclasses  # pylint: disable=import-outside-toplevel
  pg, pp, cg, cp = H.make_models()
  sao = Learner(H.learner_config("sao"), pg, pp, cg, cp, pad_id=0, vocab_size=64)
  before = jax.device_get(sao.policy.params)
  with pytest.raises(BatchError, match="^no trajectories"):
    sao.train_step([], 0)
  trajs = H.make_trajectories(pg, pp)
  for bad, what in ((None, "is NoneType None, not a real number"),
                    ("1.0", "is str '1.0', not a real number"),
                    (np.array([1.0, 0.0]), r"has shape \(2,\), not one scalar")):
    rows = trajs[:5] + [dataclasses.replace(trajs[5], reward=bad)] + trajs[6:]
    with pytest.raises(BatchError, match=f"Trajectory.reward for trajectory 5 .* {what}"):
      sao.train_step(rows, 0)
  assert H.max_abs_diff(before, jax.device_get(sao.policy.params)) == 0.0  # nothing trained
  assert sum(sao.compilations().values()) == 0
  grpo = Learner(H.learner_config("grpo_async"), pg, pp, None, None, pad_id=0, vocab_size=64)
  groups = H.make_trajectories(pg, pp, group_size=4)  # 4 whole groups of 4
  with pytest.raises(BatchError, match="prompt position 3: a group of 3 trajectories .* "
                                       "train.group_size=4"):
    grpo.train_step(groups[:15], 0)


def test_value_extremes_of_a_batch_without_action_tokens_are_nan_not_inf():
  batch = Batch.of(np.ones((2, 4), np.int32), np.zeros((2, 4)))
  zeros = jnp.zeros((2, 4))
  m = steps.batch_metrics(batch, {"advantages": zeros, "values": zeros, "returns": zeros},
                          jnp.int32(0))
  assert np.isnan(float(m["value_min"])) and np.isnan(float(m["value_max"]))
  some = Batch.of(np.ones((2, 4), np.int32), np.array([[0, 1, 1, 0], [0, 0, 0, 0]]))
  values = jnp.array([[9.0, 0.5, -0.25, 9.0], [-9.0, -9.0, -9.0, -9.0]])
  m = steps.batch_metrics(some, {"advantages": zeros, "values": values, "returns": zeros},
                          jnp.int32(0))
  assert (float(m["value_min"]), float(m["value_max"])) == (-0.25, 0.5)  # action tokens only


@pytest.mark.slow
def test_value_pretraining_step_moves_only_the_critic():
  """``critic_only_step`` (train.critic_warmup_steps > 0): K critic updates, no policy update."""
  pg, pp, cg, cp = H.make_models()
  lr = Learner(H.learner_config("sao"), pg, pp, cg, cp, pad_id=0, vocab_size=64)
  policy_before = jax.device_get(lr.policy.params)
  critic_before = jax.device_get(lr.critic.params)
  batch, micro = lr.batch(H.make_trajectories(pg, pp))
  m = lr.critic_only_step(batch, micro)
  assert set(m) >= {"value_loss", "critic_grad_norm", "explained_variance", "value_min"}
  assert np.isfinite(m["value_loss"]) and m["value_loss"] > 0
  assert H.max_abs_diff(lr.policy.params, policy_before) == 0.0
  assert H.max_abs_diff(lr.critic.params, critic_before) > 1e-4
  assert int(lr.critic.step) == 2  # K = 2 critic optimizer updates
