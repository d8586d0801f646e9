"""The main job's CLI guard: the AIME config without a checkpoint names the field to set. The
end-to-end smoke checks of the arith task (every metric, periodic eval, results.csv, checkpoints,
TensorBoard, loading the policy from a run checkpoint) run on the sao run of
tests/integration/test_modes.py; the AIME smoke run (multi-turn, the Python tool) is in
tests/unit/envs/test_tir_math.py."""

import repo_paths  # tests/repo_paths.py
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # spawns the main job (see pyproject's `slow` marker)

ROOT = repo_paths.ROOT


def test_aime_config_without_checkpoint_says_which_field_to_set():
  env = dict(os.environ, PYTHONUNBUFFERED="1")
  proc = subprocess.run([sys.executable, "-m", "sao_jax.main", "--config=configs/aime.py"],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
                        check=False)
  assert proc.returncode != 0
  assert "config.model.checkpoint_dir" in proc.stderr + proc.stdout
