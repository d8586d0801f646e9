"""The benchmark scripts' --quick modes run and produce well-formed results (no speed asserts).
The scripts (and the pipeline's child processes) use the session's compilation cache
(tests/conftest.py)."""

import repo_paths  # tests/repo_paths.py
import json
import os
import subprocess
import sys
import tempfile

import pytest

pytestmark = pytest.mark.slow  # every test here is slow (see pyproject's `slow` marker)

ROOT = repo_paths.ROOT
BENCH = os.path.join(ROOT, "benchmarks")


def _run(script, tmp_path, *extra):
  out = tmp_path / "out.json"
  proc = subprocess.run([sys.executable, os.path.join(BENCH, script), "--quick", "--json",
                         str(out), *extra], capture_output=True, text=True, cwd=ROOT,
                        check=False, timeout=600, env=dict(os.environ))
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(out.read_text())


def test_gae_quick_variants_agree(tmp_path):
  rec = _run("bench_gae.py", tmp_path)  # the script asserts the variants agree before timing
  impls = {r["impl"] for r in rec["rows"]}
  assert impls == {"lax.scan (ours)", "associative_scan", "rlax (std GAE)", "numpy loop"}
  assert all(r["ns/token"] > 0 for r in rec["rows"])


def test_train_step_quick(tmp_path):
  rec = _run("bench_train_step.py", tmp_path)
  assert {r["step"] for r in rec["rows"]} == {"policy", "critic"}
  assert rec["tiny/jit_cache_size_policy"] == 1 and rec["tiny/jit_cache_size_critic"] == 1
  assert all(0 < r["ours MFU"] and 0 < r["torch MFU"] for r in rec["rows"])
  # same weights, batch and value head: the peers' first-step losses are ours (ratios all 1, in
  # the band); Tunix (measured only where it imports) halves the value loss
  loss = rec["first_step_losses"]["tiny"]
  assert loss["torch policy"] == pytest.approx(loss["ours policy"], rel=1e-4)
  assert loss["torch critic"] == pytest.approx(loss["ours critic"], rel=1e-4)
  if "tunix policy" in loss:
    assert loss["tunix policy"] == pytest.approx(loss["ours policy"], rel=1e-4)
    assert 2 * loss["tunix critic"] == pytest.approx(loss["ours critic"], rel=1e-4)
    assert rec["tiny/tunix_jit_cache_size_policy"] == rec["tiny/tunix_jit_cache_size_critic"] == 1


def test_train_step_tunix_peer_tracks_ours():
  """Tunix's PPO steps (the JAX peer of bench_train_step.py) and ours take the same steps: three
  policy and critic updates give the same losses (PPO clip = DIS while the ratios stay in the
  band; Tunix's value loss is half ours), so its optimizer, critic and frozen attention match.
  Skipped where tunix does not import (it is installed beside the venv, see the script)."""
  pytest.importorskip("tunix.rl.algo_core")
  import numpy as np  # pylint: disable=import-outside-toplevel
  if BENCH not in sys.path:
    sys.path.insert(0, BENCH)
  import bench_train_step as bts  # pylint: disable=import-error,import-outside-toplevel
  import common  # pylint: disable=import-error,import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from sao_jax.models import hf  # pylint: disable=import-outside-toplevel
  from sao_jax.models.transformer import (  # pylint: disable=import-outside-toplevel
      Critic, Transformer, default_positions)
  from sao_jax.train import steps  # pylint: disable=import-outside-toplevel
  from sao_jax.train.batch import Batch  # pylint: disable=import-outside-toplevel
  cfg = bts.CONFIGS["tiny"]
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model)
  params = nnx.to_pure_dict(params)
  c_graphdef, c_params = nnx.split(Critic(cfg, rngs=nnx.Rngs(1)))
  c_params = nnx.to_pure_dict(c_params)
  nb = bts.make_batch(cfg, 2, 32)
  tok = jnp.asarray(nb["tokens"])
  nb["rollout_logprobs"] = np.asarray(steps.token_logprobs(model(tok, default_positions(tok))[0],
                                                           tok))
  kernel = (0.02 * np.random.default_rng(1).standard_normal((cfg.d_model, 1))).astype(np.float32)
  c_params["value_head"]["kernel"] = jnp.asarray(kernel)
  c_params["backbone"] = jax.tree.map(jnp.copy, params)
  with tempfile.TemporaryDirectory() as d:
    hf.save_hf_checkpoint(d, cfg, params)
    t_policy, t_critic = bts.tunix_steps(d, cfg, nb, kernel)
  learner, p_step, c_step = common.learner_steps(graphdef, params, c_graphdef, c_params, bts.LR)
  p_state, c_state = learner.policy, learner.critic
  batch = Batch.of(nb["tokens"], nb["action_mask"], rollout_logprobs=nb["rollout_logprobs"])
  targets = {"returns": jnp.asarray(nb["returns"]), "values": jnp.asarray(nb["values"])}
  ours, theirs = [], []
  for _ in range(3):
    p_state, pm = p_step(p_state, batch, jnp.asarray(nb["advantages"]), None)
    c_state, cm = c_step(c_state, batch, targets)
    ours.append([float(pm["policy_loss"]), float(cm["value_loss"]) / 2])
    theirs.append([float(t_policy()), float(t_critic())])
  assert len({round(x, 3) for x, _ in ours}) == 3  # the policy moves: not a fixed point
  np.testing.assert_allclose(theirs, ours, rtol=1e-4, atol=1e-6)


def test_sampler_quick(tmp_path):
  rec = _run("bench_sampler.py", tmp_path)
  assert [r["batch"] for r in rec["rows"]] == [1, 2]
  assert rec["jit_cache_sizes"]["1"]["generate"] == 1
  # ours on 1 device and (quick: 2, the batch) on 2 when the script saw 2 or more devices
  n = len(rec["machine"]["jax_devices"])
  assert "ours@1 tok/s" in rec["rows"][0] and ("ours@2 tok/s" in rec["rows"][1]) == (n >= 2)


def test_rollout_quick_both_engine_paths(tmp_path):
  rec = _run("bench_rollout.py", tmp_path)
  n = len(rec["machine"]["jax_devices"])  # the devices the script split the engine over
  split = [f"ours@{n}"] if n > 1 and 32 % n == 0 else []  # configs/arith_tool.py: 32 slots
  assert [r["path"] for r in rec["rows"]] == ["ours", "ours+overlap", *split, "jetstream_api"]
  for r in rec["rows"]:  # every problem rolled out, each with >= 1 sampled token and turn
    assert r["trajectories"] == 16 and r["action tokens"] >= 16 and r["turns / trajectory"] >= 1
  assert rec["rows"][0]["/ jetstream_api"] > 0
  if split:  # the same seed on one and on n devices: the same draws, so the same trajectories
    assert rec["rows"][2]["action tokens"] == rec["rows"][0]["action tokens"]
  assert rec["rows"][1]["overlapped calls"] > 0  # ours+overlap: calls dispatched before a read


def test_ab_engine_quick_decodes_what_it_times(tmp_path):
  """The working tree's engine against HEAD's (read with ``git show``); the script checks that
  every timed block decoded ``--new`` tokens per row (with 4 new tokens and 8 steps per call it
  once timed none)."""
  if subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                    check=False).returncode:
    pytest.skip("not a git checkout: ab_engine reads the old engine with git show")
  rec = _run("ab_engine.py", tmp_path, "--commit", "HEAD")
  assert [r["batch"] for r in rec["rows"]] == [2]
  assert all(r[k] > 0 for r in rec["rows"] for k in ("old decode tok/s", "new decode tok/s"))


@pytest.mark.parametrize("mode", ["sao"])
def test_pipeline_quick(tmp_path, mode):
  """The long-tailed setting (tool latency, env.step on a thread pool) through the whole job."""
  rec = _run("bench_pipeline.py", tmp_path, "--modes", mode, "--tool_latency", "lognormal:0.05:1")
  (row,) = rec["rows"]
  assert row["mode"] == mode and row["steps"] == 1
  assert rec["overrides"]["task.tool_latency_median_s"] == 0.05
  assert rec["tool_latency"].startswith("lognormal per tool call: median 0.05 s, sigma 1.0")
  for key in ("trainer_idle", "engine_idle", "steady_engine_busy", "steady_slot_occupancy"):
    assert 0.0 <= row[key] <= 1.0, key
