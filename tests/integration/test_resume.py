"""Exact resume: the main job is SIGKILLed during a rollout, a train step and a checkpoint save,
resumed each time, and ends bit-identical to an uninterrupted run with the same seed."""

import repo_paths  # tests/repo_paths.py
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
import orbax.checkpoint as ocp
import pytest

pytestmark = pytest.mark.slow  # every test here is slow (see pyproject's `slow` marker)

ROOT = repo_paths.ROOT
STEPS = 4
ARGS = ["--config=configs/arith_tool.py:smoke", "--config.sft.steps=0", "--config.task.n_eval=2",
        "--config.eval.every_steps=0", "--config.model.d_model=32", "--config.model.n_layers=1",
        "--config.model.n_heads=2", "--config.model.n_kv_heads=1", "--config.model.head_dim=16",
        "--config.model.d_ff=64", "--config.rollout.lockstep=True",
        "--config.checkpoint.every_steps=1", f"--config.train.num_steps={STEPS}",
        "--config.log.tensorboard=False",
        "--config.train.critic_warmup_steps=0"]  # the ledger / batch counts are policy steps'


def _run(run_dir, kill=None, background=False):
  env = dict(os.environ, PYTHONUNBUFFERED="1")
  env.pop("SAO_FAULT_KILL", None)
  if kill:
    env["SAO_FAULT_KILL"] = kill
  cmd = [sys.executable, "-m", "sao_jax.main", *ARGS, f"--config.run_dir={run_dir}"]
  if background:
    log = open(os.path.join(str(run_dir), "stderr.log"), "w")  # a file: a pipe could fill up
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=log)
  return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
                        check=False)


def _jsonl(path):
  return [json.loads(l) for l in open(path)]


def _final_state(run_dir):
  mngr = ocp.CheckpointManager(os.path.join(run_dir, "checkpoints"))
  step = mngr.latest_step()
  raw = mngr.restore(step, args=ocp.args.StandardRestore())
  meta = dict(mngr.metadata(step).custom_metadata)
  mngr.close()
  return step, raw, meta


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """The crash chain and an uninterrupted run. They (and the asynchronous runs below) compile the
  same programs: after the first, each reads them from the session's compilation cache
  (tests/conftest.py; a cold run of this tiny model spends most of its time compiling)."""
  ref = tmp_path_factory.mktemp("uninterrupted")
  ref_proc = _run(ref, background=True)  # runs alongside the crash chain
  crashed = tmp_path_factory.mktemp("crashed")
  log = []
  for kill in ("rollout:2", "train:3", "checkpoint:4", None):
    proc = _run(crashed, kill=kill)
    out = proc.stdout + proc.stderr
    resumed = [l for l in out.splitlines() if l.startswith("resuming from")]
    log.append((kill, proc.returncode, resumed[0].split()[-1] if resumed else None))
    if kill:
      assert proc.returncode == -9, out[-3000:]  # SIGKILL
      assert f"fault injection: SIGKILL at {kill.replace(':', ' of step ')}" in out
    else:
      assert proc.returncode == 0, out[-3000:]
  ref_proc.wait(timeout=600)
  assert ref_proc.returncode == 0, open(ref / "stderr.log").read()[-3000:]
  return ref, crashed, log


def test_each_crash_resumes_from_the_last_complete_checkpoint(runs):
  _, _, log = runs
  assert [k for k, _, _ in log] == ["rollout:2", "train:3", "checkpoint:4", None]
  # log[i][2] is the step run i resumed from. Saves are asynchronous, so a checkpoint whose
  # commit the SIGKILL interrupted is not complete and must not be picked: the resumed step is
  # the newest *committed* one, which is the step before the kill or one earlier.
  assert log[0][2] is None                 # first run: nothing to resume
  assert log[1][2] in (None, "1")          # killed during step 2's rollout
  assert log[2][2] in ("1", "2")           # killed after step 3's update, before its save
  assert log[3][2] in ("3", "4")           # killed right after step 4's save started

def test_resumed_run_equals_uninterrupted_run(runs):
  ref, crashed, _ = runs
  step_a, a, meta_a = _final_state(ref)
  step_b, b, meta_b = _final_state(crashed)
  assert step_a == step_b == STEPS
  assert meta_a == meta_b  # step, policy_version, data cursor / ledger, counters
  assert meta_a["policy_version"] == STEPS and meta_a["ledger"]["low"] == STEPS * 8
  la, lb = (jax_leaves(a)), (jax_leaves(b))
  assert [p for p, _ in la] == [p for p, _ in lb]
  for (path, x), (_, y) in zip(la, lb):  # params, both optimizer states, step counters
    np.testing.assert_array_equal(x, y, err_msg=path)
  assert any("opt_state" in p for p, _ in la) and any("critic" in p for p, _ in la)


def test_every_batch_and_metric_equal_and_no_prompt_counted_twice(runs):
  ref, crashed, _ = runs
  ledger_a, ledger_b = _jsonl(ref / "ledger.jsonl"), _jsonl(crashed / "ledger.jsonl")
  assert [r["step"] for r in ledger_b] == list(range(1, STEPS + 1))  # redone steps not doubled
  assert ledger_a == ledger_b  # same prompts, same tokens/log-probs/rewards, every step
  positions = [p for r in ledger_b for p in r["positions"]]
  assert sorted(positions) == list(range(STEPS * 8))  # each prompt once, none skipped
  ma = [r for r in _jsonl(ref / "metrics.jsonl") if "policy_loss" in r]
  mb = [r for r in _jsonl(crashed / "metrics.jsonl") if "policy_loss" in r]
  assert [r["step"] for r in mb] == list(range(1, STEPS + 1))
  for ra, rb in zip(ma, mb):
    for k in ("policy_loss", "value_loss", "policy_grad_norm", "reward_mean", "policy_version"):
      assert ra[k] == rb[k], (ra["step"], k)


def jax_leaves(tree):
  import jax  # pylint: disable=import-outside-toplevel
  return [(jax.tree_util.keystr(p), np.asarray(v))
          for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]]


# ---- an asynchronous run (no lockstep): the driver is SIGKILLed and resumed --------------------
@pytest.mark.parametrize("backend", ["thread", "ray"])
def test_killed_async_run_resumes_and_consumes_every_prompt_once(tmp_path, backend):
  """Not bit-exact (asynchronous sampling), but exactly-once: the ledger of the resumed run has
  steps 1..4 once each, every trained prompt position once, and the checkpoint's cursor covers
  exactly those positions. Both backends read the lockstep runs' programs from the session's
  compilation cache (Ray's actors inherit it), so they compile little.

  A laptop run opens no port to the network: every TCP socket that any process of either run
  listens on (with Ray: GCS, raylet, agents, core workers, the transfer weight sync's servers)
  is bound to loopback. With Ray, the killed driver's local cluster is cleaned up by the test,
  and the resumed run's ``ray.shutdown`` leaves no Ray process."""
  if backend == "ray":
    pytest.importorskip("ray")
  pytest.importorskip("psutil")
  # pylint: disable-next=import-outside-toplevel  (tests/ helpers)
  from test_ray_source import _ray_processes, assert_loopback_only, run_watching_sockets
  args = [a for a in ARGS if "lockstep" not in a and "checkpoint.every_steps" not in a]
  args += ["--config.checkpoint.every_steps=1", f"--config.rollout.backend={backend}"]
  if backend == "ray":
    args += ["--config.rollout.num_workers=2", "--config.rollout.ray_num_cpus=0.5",
             "--config.rollout.weight_sync=transfer"]
  cmd = [sys.executable, "-m", "sao_jax.main", *args, f"--config.run_dir={tmp_path / 'run'}"]
  # the driver's own Ray temp dir (short: Ray's unix sockets live under it), so that only the
  # Ray this test started is cleaned up after the SIGKILL, never another one on the machine
  ray_dir = tempfile.mkdtemp(prefix="sao_ray_", dir="/tmp")
  env = dict(os.environ, PYTHONUNBUFFERED="1", RAY_TMPDIR=ray_dir)
  env.pop("SAO_FAULT_KILL", None)
  env.pop("RAY_ADDRESS", None)
  seen: dict = {}
  try:
    # the thread run dies after step 3's update; the Ray run with half of step 3's batch in
    kill = "train:3" if backend == "thread" else "rollout:3"
    rc, killed = run_watching_sockets(cmd, dict(env, SAO_FAULT_KILL=kill),
                                      tmp_path / "killed.log", seen)
    assert rc == -9, killed[-4000:]
    assert f"fault injection: SIGKILL at {kill.replace(':', ' of step ')}" in killed
    for pid in _ray_processes(under=ray_dir):  # a SIGKILLed driver cannot stop its Ray
      os.kill(pid, signal.SIGKILL)
    rc, resumed = run_watching_sockets(cmd, env, tmp_path / "resumed.log", seen)
    assert rc == 0, resumed[-4000:]
    deadline = time.time() + 20  # the driver's ray.shutdown stops its Ray; give it a moment
    while _ray_processes(under=ray_dir) and time.time() < deadline:
      time.sleep(0.5)
    left = _ray_processes(under=ray_dir)
  finally:  # only if a run failed
    for pid in _ray_processes(under=ray_dir):
      os.kill(pid, signal.SIGKILL)
    shutil.rmtree(ray_dir, ignore_errors=True)
  assert_loopback_only(seen, ray=backend == "ray")
  assert not left, "a raylet / gcs_server outlived the resumed run"
  assert "resuming from" in resumed
  ledger = _jsonl(tmp_path / "run" / "ledger.jsonl")
  assert [r["step"] for r in ledger] == list(range(1, STEPS + 1))
  positions = [p for r in ledger for p in r["positions"]]
  assert len(positions) == len(set(positions)) == STEPS * 8
  _, _, meta = _final_state(tmp_path / "run")
  cursor = set(range(meta["ledger"]["low"])) | set(meta["ledger"]["extra"])
  assert cursor == set(positions)
