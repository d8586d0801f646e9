"""Every training mode runs the CPU task end to end (in process, tiny model), grpo_sync really
waits at the batch barrier and sao really does not; the sao run also evaluates periodically,
checkpoints and writes TensorBoard files, and its checkpoint loads as a policy (the main job's
smoke checks, one run for both); mode plumbing unit tests."""

import contextlib
import csv
import io
import itertools
import json
import os

import numpy as np
import pytest
from flax import nnx

from sao_jax import configs
from sao_jax.models.transformer import ModelConfig, Transformer
from sao_jax.rollout import assembler, staleness
from sao_jax.rollout.ledger import PromptLedger
from sao_jax.rollout.trajectory import Trajectory
from sao_jax.train import loop, modes
from sao_jax.train.baselines import RunningMeanBaseline
from sao_jax.train.checkpoint import load_policy_params

# a tiny model, 4 steps, no SFT; the sao run also does what a user's run does: periodic eval,
# checkpoints, TensorBoard
_TINY = {"model.d_model": 32, "model.n_layers": 1, "model.d_ff": 64, "model.n_heads": 2,
         "model.n_kv_heads": 1, "model.head_dim": 16, "sft.steps": 0, "task.n_eval": 4,
         "eval.every_steps": 0, "checkpoint.every_steps": 0, "log.tensorboard": False,
         "train.group_size": 4, "train.num_steps": 4}
_SAO_EXTRA = {"task.n_eval": 16, "eval.every_steps": 2, "checkpoint.every_steps": 2,
              "log.tensorboard": True}
_TINY_MODEL = ModelConfig(vocab_size=104, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1,
                          head_dim=16, d_ff=64, max_seq_len=64)


@pytest.fixture(scope="module")
def mode_runs(tmp_path_factory):
  """{mode: (run_dir, stdout, metrics.jsonl training records)} of a 4-step main job
  (``loop.run``, what ``python -m sao_jax.main --config=configs/arith_tool.py:smoke`` calls) of
  every mode, one after another in this process: they share its compiled programs (the CLI's
  flag parsing is exercised by the subprocess runs of test_resume.py and the experiments)."""
  out = {}
  for mode in modes.MODES:
    run_dir = str(tmp_path_factory.mktemp(mode))
    c = configs.load("arith_tool", "smoke")
    c.update_from_flattened_dict({**_TINY, **(_SAO_EXTRA if mode == "sao" else {}),
                                  "train.mode": mode, "run_dir": run_dir})
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
      loop.run(c)
    stdout = buf.getvalue()
    assert "Held-out evaluation" in stdout, (mode, stdout[-2000:])
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
      out[mode] = (run_dir, stdout, [r for r in map(json.loads, f) if "policy_loss" in r])
  return out


@pytest.mark.slow
def test_sao_run_logs_every_metric_evaluates_and_writes_results(mode_runs):
  run_dir, stdout, train = mode_runs["sao"]
  assert "Held-out evaluation" in stdout and "after SAO" in stdout
  assert [r["step"] for r in train] == [1, 2, 3, 4]
  for key in ("reward_mean", "masked_fraction", "masked_fraction_low", "masked_fraction_high",
              "ratio_mean", "ratio_max", "abs_logp_diff_mean", "value_loss",
              "explained_variance", "staleness_mean", "staleness_max", "tokens_per_s",
              "wait_s", "train_s", "rollout_generate_s"):
    assert all(np.isfinite(r[key]) for r in train), key
  # every 2 steps; the last step's eval is the final one (results.csv)
  assert [r["step"] for r in train if "eval_accuracy" in r] == [2]
  with open(os.path.join(run_dir, "results.csv")) as f:
    results = dict(csv.reader(f))
  assert 0.0 <= float(results["accuracy_after"]) <= 1.0
  assert int(results["eval_problems"]) == 16
  assert os.path.isdir(os.path.join(run_dir, "checkpoints"))
  assert os.listdir(os.path.join(run_dir, "tb"))


@pytest.mark.slow
def test_policy_loads_from_a_run_checkpoint(mode_runs):
  run_dir = mode_runs["sao"][0]
  fresh = nnx.to_pure_dict(nnx.split(Transformer(_TINY_MODEL, rngs=nnx.Rngs(123)))[1])
  loaded = load_policy_params(os.path.join(run_dir, "checkpoints"), fresh)
  a = np.asarray(loaded["layers"][0]["mlp"]["up_proj"]["kernel"])
  assert a.shape == (32, 64)
  assert not np.array_equal(a, np.asarray(fresh["layers"][0]["mlp"]["up_proj"]["kernel"]))
  wrong = nnx.to_pure_dict(nnx.split(Transformer(
      ModelConfig(vocab_size=104, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=8,
                  d_ff=64), rngs=nnx.Rngs(0)))[1])
  with pytest.raises(ValueError, match="shape"):
    load_policy_params(os.path.join(run_dir, "checkpoints"), wrong)
  with pytest.raises(FileNotFoundError):
    load_policy_params(os.path.join(run_dir, "nope"), fresh)


_SHARED_KEYS = ("masked_fraction", "masked_fraction_low", "masked_fraction_high",
                "masked_fraction_pos_adv", "masked_fraction_neg_adv", "ratio_mean", "ratio_min",
                "ratio_max", "ess_fraction", "abs_logp_diff_mean", "approx_kl_k3",
                "mismatch_abs_logp", "mismatch_exp_abs_minus_1", "mismatch_kl_k3", "entropy",
                "advantage_mean", "advantage_std", "policy_grad_norm", "staleness_max")


@pytest.mark.slow
@pytest.mark.parametrize("mode", modes.MODES)
def test_every_mode_runs_and_logs_the_shared_metrics(mode_runs, mode):
  recs = mode_runs[mode][2]
  assert [r["step"] for r in recs] == [1, 2, 3, 4]
  assert [r["policy_version"] for r in recs] == [1, 2, 3, 4]
  for key in _SHARED_KEYS:
    assert all(np.isfinite(r[key]) for r in recs), (mode, key)
  assert all(r["entropy"] > 0 for r in recs)  # a random policy at temperature 1
  critic = mode in ("sao", "vapo")
  for key in ("value_loss", "explained_variance", "critic_grad_norm"):
    assert all((key in r) == critic for r in recs), (mode, key)
  if mode in ("vapo", "grpo_sync", "grpo_async"):
    # PPO clip against the recomputed old policy with one update per batch: ratio exactly 1.
    assert all(r["ratio_min"] == r["ratio_max"] == 1.0 for r in recs)
  if mode.startswith("grpo"):
    # Group-normalised advantages have mean 0 per group, hence over whole trajectories.
    assert all(abs(r["advantage_mean"]) < 0.5 for r in recs)


@pytest.mark.slow
def test_grpo_sync_waits_at_the_batch_barrier(mode_runs):
  recs = mode_runs["grpo_sync"][2]
  for prev, cur in zip(recs, recs[1:]):
    # Every rollout of batch n+1 was admitted after step n published its weights ...
    assert cur["traj_t_start_min"] >= prev["step_t_publish"]
  for r in recs:
    # ... and step n started only after the slowest rollout of its batch finished.
    assert r["traj_t_end_max"] <= r["step_t_begin"]
    assert r["staleness_max"] == 0.0


@pytest.mark.slow
def test_sao_and_grpo_async_do_not_wait(mode_runs):
  for mode in ("sao", "grpo_async"):
    recs = mode_runs[mode][2]
    overlapped = [cur["traj_t_start_min"] < prev["step_t_publish"]
                  for prev, cur in zip(recs, recs[1:])]
    # Rollouts of later batches began while earlier steps trained, sampled by old weights.
    assert any(overlapped), mode
    assert max(r["staleness_max"] for r in recs) >= 1, mode


# ---- plumbing --------------------------------------------------------------------------------


def _traj(pid, reward=0.0, versions=(0,), position=-1):
  n = len(versions)
  return Trajectory(problem_id=pid, tokens=np.zeros(n + 1, np.int32),
                    action_mask=np.r_[0.0, np.ones(n)].astype(np.float32),
                    logprobs=np.zeros(n + 1, np.float32),
                    policy_version=np.r_[-1, versions].astype(np.int32), reward=reward,
                    prompt_position=position)


def test_resolve_defaults_and_errors():
  assert modes.resolve("sao") == modes.ModeSpec("sao", "dis", "skip_obs_gae", 1, True, False)
  assert modes.resolve("vapo").objective == "ppo_clip"
  spec = modes.resolve("grpo_sync", group_size=4, batch_size=8)
  assert (spec.estimator, spec.uses_critic, spec.synchronous) == ("grpo", False, True)
  assert not modes.resolve("sao", estimator="running_mean_prompt").uses_critic
  with pytest.raises(ValueError, match="train.mode"):
    modes.resolve("ppo")
  with pytest.raises(ValueError, match="train.objective"):
    modes.resolve("sao", objective="trpo")
  with pytest.raises(ValueError, match="train.advantage_estimator"):
    modes.resolve("sao", estimator="vtrace")
  with pytest.raises(ValueError, match="multiple of train.group_size"):
    modes.resolve("grpo_async", group_size=3, batch_size=8)
  with pytest.raises(ValueError, match="needs groups"):
    modes.resolve("sao", estimator="grpo")


def test_groups_gate_and_staleness():
  """The source's group plumbing: each hand-out repeated G times keeps its ledger position,
  the gate hands out only what was released, the collector groups by position."""
  from sao_jax.data.jsonl import Problem  # pylint: disable=import-outside-toplevel
  ledger = PromptLedger([Problem("a", "p", "1"), Problem("b", "q", "2")], seed=0)
  members = list(itertools.islice(assembler.repeat_groups(ledger, 3), 6))
  assert [h.position for h in members] == [0, 0, 0, 1, 1, 1]
  assert len({h.id for h in members[:3]}) == 1
  gate = assembler.GatedProblems(iter(range(10)))
  assert next(gate) is None
  gate.release(2)
  assert [next(gate), next(gate), next(gate)] == [0, 1, None]
  col = assembler.GroupCollector(2)
  assert col.add(_traj("x", position=4)) == [] and col.add(_traj("y", position=5)) == []
  assert col.pending == 2
  done = col.add(_traj("x", position=4))
  assert len(done) == 1 and [t.prompt_position for t in done[0]] == [4, 4] and col.pending == 1
  assert not staleness.is_too_stale(_traj("x", versions=(3, 5)), 7, 4)
  assert staleness.is_too_stale(_traj("x", versions=(2, 5)), 7, 4)


def test_running_mean_baselines():
  """Per prompt, window 2: a:1 scored against [] -> baseline 0 (empty); a:0 against [1] -> 1;
  b:1 against [] -> 0; a:1 against [1, 0] -> 0.5; a:1 against [0, 1] -> 0.5 (the first 1 left
  the window). Global window 3: [] -> 0, [1] -> 1, [1, 0] -> 0.5, [1, 0, 0] -> 1/3."""
  rm = RunningMeanBaseline(2, per_key=True)
  base, nonempty = rm(["a", "a", "b", "a", "a"], [1.0, 0.0, 1.0, 1.0, 1.0])
  np.testing.assert_allclose(base, [0.0, 1.0, 0.0, 0.5, 0.5])
  assert nonempty.tolist() == [False, True, False, True, True]
  glob = RunningMeanBaseline(3, per_key=False)
  base, nonempty = glob(["a", "b", "c", "d"], [1.0, 0.0, 0.0, 1.0])
  np.testing.assert_allclose(base, [0.0, 1.0, 0.5, 1 / 3])
  assert nonempty.tolist() == [False, True, True, True]
  with pytest.raises(ValueError, match="baseline_window"):
    RunningMeanBaseline(0)
