"""The main job end to end (CLI, subprocess): arith smoke run, AIME config guard (the AIME smoke
run, multi-turn with the Python tool, is in tests/test_tir_math.py), and loading the policy from a
checkpoint written by a run."""

import csv
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from flax import nnx

from sao_jax.models.transformer import ModelConfig, Transformer
from sao_jax.train.checkpoint import load_policy_params

pytestmark = pytest.mark.slow  # every test here is slow (see pyproject's `slow` marker)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _main(*args, timeout=600):
  env = dict(os.environ, PYTHONUNBUFFERED="1")
  return subprocess.run([sys.executable, "-m", "sao_jax.main", *args], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=timeout, check=False)


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
  run_dir = str(tmp_path_factory.mktemp("smoke"))
  proc = _main("--config=configs/arith_tool.py:smoke", f"--config.run_dir={run_dir}")
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  return run_dir, proc.stdout


def test_smoke_run_logs_every_metric_and_writes_results(smoke_run):
  run_dir, stdout = smoke_run
  assert "Held-out evaluation" in stdout and "after SAO" in stdout
  records = [json.loads(l) for l in open(os.path.join(run_dir, "metrics.jsonl"))]
  train = [r for r in records if "policy_loss" in r]
  assert [r["step"] for r in train] == [1, 2, 3]
  for key in ("reward_mean", "masked_fraction", "masked_fraction_low", "masked_fraction_high",
              "ratio_mean", "ratio_max", "abs_logp_diff_mean", "value_loss",
              "explained_variance", "staleness_mean", "staleness_max", "tokens_per_s",
              "wait_s", "train_s", "rollout_generate_s"):
    assert all(np.isfinite(r[key]) for r in train), key
  assert [r["policy_version"] for r in train] == [1, 2, 3]
  assert any("eval_accuracy" in r for r in train)  # periodic eval (every 2 steps)
  with open(os.path.join(run_dir, "results.csv")) as f:
    results = dict(csv.reader(f))
  assert 0.0 <= float(results["accuracy_after"]) <= 1.0
  assert int(results["eval_problems"]) == 16
  assert os.path.isdir(os.path.join(run_dir, "checkpoints"))
  assert os.listdir(os.path.join(run_dir, "tb"))


def test_aime_config_without_checkpoint_says_which_field_to_set():
  proc = _main("--config=configs/aime.py", timeout=120)
  assert proc.returncode != 0
  assert "config.model.checkpoint_dir" in proc.stderr + proc.stdout


def test_policy_loads_from_a_run_checkpoint(smoke_run):
  run_dir, _ = smoke_run
  cfg = ModelConfig(vocab_size=104, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2,
                    head_dim=32, d_ff=384, max_seq_len=64)
  fresh = nnx.to_pure_dict(nnx.split(Transformer(cfg, rngs=nnx.Rngs(123)))[1])
  loaded = load_policy_params(os.path.join(run_dir, "checkpoints"), fresh)
  a = np.asarray(loaded["layers"][0]["mlp"]["up_proj"]["kernel"])
  assert a.shape == (128, 384)
  assert not np.array_equal(a, np.asarray(fresh["layers"][0]["mlp"]["up_proj"]["kernel"]))
  wrong = nnx.to_pure_dict(nnx.split(Transformer(
      ModelConfig(vocab_size=104, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                  d_ff=384), rngs=nnx.Rngs(0)))[1])
  with pytest.raises(ValueError, match="shape"):
    load_policy_params(os.path.join(run_dir, "checkpoints"), wrong)
  with pytest.raises(FileNotFoundError):
    load_policy_params(os.path.join(run_dir, "nope"), fresh)
