"""Placement (``rollout/placement.py``, ``rollout.devices`` / ``rollout.mesh``): the device split,
the rollout mesh and their config errors; on 8 forced CPU devices (subprocesses): a weight publish
from a 4-device learner into a 4-device rollout mesh moves no full copy through one device or the
host, the engine keeps generating while the trainer trains, and the main job runs split 4 + 4."""

import repo_paths  # tests/repo_paths.py
import csv
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from conftest import with_test_xla_flags  # tests/conftest.py
from sao_jax import configs
from sao_jax.roles import ConfigError
from sao_jax.rollout import placement
from sao_jax.train.validation import config_warnings, validate_config

ROOT = repo_paths.ROOT


def _env():
  return dict(os.environ, XLA_FLAGS=with_test_xla_flags("--xla_force_host_platform_device_count=8"),
              JAX_PLATFORMS="cpu", PYTHONPATH=ROOT, PYTHONUNBUFFERED="1")


def _script(name: str) -> list[dict]:
  proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "scripts", name)],
                        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  return [json.loads(l) for l in proc.stdout.splitlines() if l.startswith("{")]


def test_rollout_shape_resolves_the_three_axes_and_names_the_field():
  assert placement.rollout_shape("data=-1", 4) == {"data": 4, "tensor": 1, "expert": 1}
  assert placement.rollout_shape("", 2) == {"data": 2, "tensor": 1, "expert": 1}
  assert placement.rollout_shape("tensor=2,data=-1", 8) == {"data": 4, "tensor": 2, "expert": 1}
  assert placement.rollout_shape("data=1,tensor=2,expert=2", 4) == {"data": 1, "tensor": 2,
                                                                    "expert": 2}
  for text, what in (("fsdp=4", "unknown axis 'fsdp'"), ("tensor=3", "needs 3 device(s)"),
                     ("data=-1,tensor=-1", "at most one -1"), ("tensor", "entries look like"),
                     ("tensor=3,data=-1", "needs 3 device(s) (times -1)")):
    with pytest.raises(ValueError, match="rollout.mesh") as e:
      placement.rollout_shape(text, 4)
    assert what in str(e.value), (text, str(e.value))


def test_split_devices_gives_the_rollout_the_first_n():
  assert placement.split_devices("abcd", 1) == (["a"], ["b", "c", "d"])
  for n in (0, 4):
    with pytest.raises(ValueError, match=r"rollout.devices=\d must be in 1..3"):
      placement.split_devices("abcd", n)


def test_reshard_on_one_device_is_a_copy_with_the_values():
  x = {"a": jax.numpy.arange(6.0).reshape(2, 3), "s": jax.numpy.int32(7)}
  out = placement.reshard(x, placement.serving_shardings(x, None))
  assert out["a"].devices() == {jax.local_devices()[0]} and int(out["s"]) == 7
  np.testing.assert_array_equal(np.asarray(out["a"]), np.arange(6.0).reshape(2, 3))
  assert out["a"].unsafe_buffer_pointer() != x["a"].unsafe_buffer_pointer()  # never aliased
  mesh = Mesh(np.array(jax.local_devices()[:1]), ("data",))
  rep = placement.reshard(x["a"], NamedSharding(mesh, P()))
  assert rep.sharding == NamedSharding(mesh, P())
  with pytest.raises(ValueError, match="fully addressable"):
    placement.reshard(np.zeros(3), NamedSharding(mesh, P()))


def _problems(num_devices: int = 8, **fields) -> str:
  c = configs.load("arith_tool", "smoke")
  for k, v in fields.items():
    sec, name = k.split("__")
    c[sec][name] = v
  try:
    validate_config(c, num_devices=num_devices)
  except ConfigError as e:
    return str(e)
  return ""


def test_bad_placements_are_config_errors_naming_the_field_and_fix():
  assert _problems(rollout__devices=4, mesh__shape="fsdp=-1") == ""
  assert _problems(rollout__devices=4, rollout__mesh="data=2,tensor=2", mesh__shape="fsdp=4") == ""
  text = _problems(rollout__devices=8)
  assert "config.rollout.devices = 8: this machine has 8 device(s)" in text
  assert "fix: use at most 7" in text
  text = _problems(rollout__devices=4, rollout__mesh="data=3")
  assert "config.rollout.mesh = 'data=3': needs 3 device(s) but the rollout has 4" in text
  text = _problems(rollout__devices=4, mesh__shape="fsdp=8")
  assert "config.mesh.shape = 'fsdp=8': needs 8 devices" in text and "learner has 4" in text
  text = _problems(rollout__devices=2, rollout__backend="ray")
  assert "config.rollout.devices = 2: places the in-process engine" in text
  assert "fix: set rollout.devices=0" in text
  text = _problems(rollout__devices=3, rollout__mesh="data=-1", mesh__shape="fsdp=-1")
  assert "config.rollout.slots = 8: must be a multiple of rollout.mesh's data axis (3" in text
  assert "config.eval.slots = 16" in text
  text = _problems(num_devices=1, rollout__mesh="tensor=2")  # devices 0: one shared device
  assert "config.rollout.mesh = 'tensor=2': needs 2 device(s) but the rollout has 1" in text
  # the KV cache splits by KV heads: the arith model's 2 refuse tensor=4 before anything is built
  text = _problems(rollout__devices=4, rollout__mesh="tensor=4", mesh__shape="fsdp=-1")
  assert "config.rollout.mesh = 'tensor=4': its tensor axis (4) must divide model.n_kv_heads " \
      "(2;" in text and "fix: a tensor size that divides 2" in text
  assert _problems(rollout__devices=4, rollout__mesh="data=2,tensor=2", mesh__shape="fsdp=-1") == ""


def test_placements_that_idle_or_copy_devices_warn():
  c = configs.load("arith_tool", "smoke")
  c.rollout.devices = 4
  (line,) = config_warnings(c)  # mesh.shape '': the learner takes one of the other 4
  assert line.startswith("warning: rollout.devices=4 with mesh.shape='': the learner uses one "
                         "device") and "--config.mesh.shape=fsdp=-1" in line
  c.mesh.shape = "fsdp=-1"
  assert config_warnings(c) == []
  c.rollout.mesh = "data=2,expert=2"  # a dense model: the expert axis holds copies
  (line,) = config_warnings(c)
  assert "has an expert axis but model.n_experts=0" in line and "put those devices on data" in line
  c.model.n_experts = 4
  assert config_warnings(c) == []


@pytest.mark.slow
def test_publish_moves_no_full_copy_through_one_device_or_the_host():
  """Learner fsdp=4 on devices 4-7 (float32 master), rollout on devices 0-3, served in bfloat16,
  into two layouts: replicated over data=4 (today's engine) and tensor=4 (a tensor-parallel
  engine's). Host transfers raise during the publish (transfer guard). The bound, per device:
  peak - before <= (its block of the published copy) + (the learner's shards there, cast to
  bfloat16) + (one piece: the largest learner shard of any array); nothing is left behind."""
  for r in _script("publish_bound.py"):
    assert r["equal"], r["layout"]
    assert r["rollout_devices"] == [0, 1, 2, 3] and r["learner_devices"] == [4, 5, 6, 7]
    for d in range(8):
      before, peak, after = (r[k].get(str(d), 0) for k in ("before", "peak", "after"))
      held = r["held"].get(str(d), 0)
      cast = r["cast"].get(str(d), 0)
      assert peak - before <= held + cast + r["piece"], (r["layout"], d, peak, before, held, cast)
      assert after - before == held, (r["layout"], d)  # no leftover buffer
    if r["layout"] == "tensor":  # every device holds about a quarter; none ever a full copy
      assert all(r["peak"][str(d)] < r["total"] / 2 for d in range(8) if d < 4), r
      assert all(h < r["total"] / 2 for h in r["held"].values()), r
    else:
      assert all(h == r["total"] for h in r["held"].values()), r  # a replica per device
    # the learner's devices hold a quarter of the cast tree each, never the whole
    assert all(r["cast"][str(d)] < r["total"] / 2 for d in range(4, 8)), r


@pytest.mark.slow
def test_engine_and_trainer_on_disjoint_submeshes():
  r = _script("submesh_sync.py")[-1]
  print(r)
  assert r["engine_devices"] == [0, 1, 2, 3] and r["trainer_devices"] == [4, 5, 6, 7]
  assert r["decode_state_devices"] == [0, 1, 2, 3]
  assert r["store_version"] == 5 and r["engine_version"] >= 4 and r["worker_error"] == "None"
  # weights published after each step reached the engine: later batches carry newer versions
  assert max(r["versions_seen"]) >= 1
  # the engine generated while the trainer trained (wall-clock intervals intersect)
  assert r["overlap_s"] > 0 and r["generate_steps_during_training"] >= 1


@pytest.mark.slow
def test_main_job_runs_split_four_and_four(tmp_path):
  run_dir = str(tmp_path / "run")
  proc = subprocess.run(
      [sys.executable, "-m", "sao_jax.main", "--config=configs/arith_tool.py:smoke",
       f"--config.run_dir={run_dir}", "--config.rollout.devices=4", "--config.mesh.shape=fsdp=-1",
       "--config.log.progress=lines",
       # the placement is under test, not the warm start or the periodic eval / checkpoints
       "--config.sft.steps=0", "--config.eval.every_steps=0", "--config.checkpoint.every_steps=0",
       "--config.log.tensorboard=False"],
      cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=900, check=False)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert ("placement: learner on devices [4, 5, 6, 7] {'fsdp': 4}, rollout on "
          "[0, 1, 2, 3] {'data': 4, 'tensor': 1, 'expert': 1}") in proc.stdout
  records = [json.loads(l) for l in open(os.path.join(run_dir, "metrics.jsonl"))]
  train = [r for r in records if "policy_loss" in r]
  assert [r["policy_version"] for r in train] == [1, 2, 3]
  assert all(np.isfinite(r["policy_loss"]) for r in train)
  with open(os.path.join(run_dir, "results.csv")) as f:
    results = dict(csv.reader(f))
  assert int(results["eval_problems"]) == 16 and int(results["trajectories_generated"]) >= 40
