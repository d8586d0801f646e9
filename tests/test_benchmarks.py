"""The benchmark scripts' --quick modes run and produce well-formed results (no speed asserts)."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")


def _run(script, tmp_path, *extra):
  out = tmp_path / "out.json"
  proc = subprocess.run([sys.executable, os.path.join(BENCH, script), "--quick", "--json",
                         str(out), *extra], capture_output=True, text=True, cwd=ROOT,
                        check=False, timeout=600)
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


def test_sampler_quick(tmp_path):
  rec = _run("bench_sampler.py", tmp_path)
  assert [r["batch"] for r in rec["rows"]] == [1, 2]
  assert rec["jit_cache_sizes"]["1"]["generate"] == 1


@pytest.mark.parametrize("mode", ["sao"])
def test_pipeline_quick(tmp_path, mode):
  rec = _run("bench_pipeline.py", tmp_path, "--modes", mode)
  (row,) = rec["rows"]
  assert row["mode"] == mode and row["steps"] == 1
  assert 0.0 <= row["trainer_idle"] <= 1.0
