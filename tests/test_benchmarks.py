"""The benchmark scripts' --quick modes run and produce well-formed results (no speed asserts).

The scripts (and the pipeline's child processes) share a persistent JAX compilation cache across
test sessions (``JAX_COMPILATION_CACHE_DIR``; default ``$TMPDIR/sao_jax_jit_cache_<uid>``,
override with ``SAO_JAX_TEST_COMPILE_CACHE``; ``SAO_JAX_TEST_COMPILE_CACHE=off`` disables it):
compilation is most of a quick run, and a warm cache skips it. Entries are keyed by the program,
the jax/XLA version and the flags, so a stale entry is never reused for a different program."""

import json
import os
import subprocess
import sys
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")


def _cache_env() -> dict:
  cache = os.environ.get("SAO_JAX_TEST_COMPILE_CACHE",
                         os.path.join(tempfile.gettempdir(), f"sao_jax_jit_cache_{os.getuid()}"))
  if cache == "off":
    return {}
  return {"JAX_COMPILATION_CACHE_DIR": cache,
          "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",  # cache every compiled program
          "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}


def _run(script, tmp_path, *extra):
  out = tmp_path / "out.json"
  proc = subprocess.run([sys.executable, os.path.join(BENCH, script), "--quick", "--json",
                         str(out), *extra], capture_output=True, text=True, cwd=ROOT,
                        check=False, timeout=600, env=dict(os.environ, **_cache_env()))
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
  # ours on 1 device and (quick: 2, the batch) on 2 when the script saw 2 or more devices
  n = len(rec["machine"]["jax_devices"])
  assert "ours@1 tok/s" in rec["rows"][0] and ("ours@2 tok/s" in rec["rows"][1]) == (n >= 2)


def test_rollout_quick_both_engine_paths(tmp_path):
  rec = _run("bench_rollout.py", tmp_path)
  n = len(rec["machine"]["jax_devices"])  # the devices the script split the engine over
  split = [f"ours@{n}"] if n > 1 and 32 % n == 0 else []  # configs/arith_tool.py: 32 slots
  assert [r["path"] for r in rec["rows"]] == ["ours", *split, "jetstream_api"]
  for r in rec["rows"]:  # every problem rolled out, each with >= 1 sampled token and turn
    assert r["trajectories"] == 16 and r["action tokens"] >= 16 and r["turns / trajectory"] >= 1
  assert rec["rows"][0]["/ jetstream_api"] > 0
  if split:  # the same seed on one and on n devices: the same draws, so the same trajectories
    assert rec["rows"][1]["action tokens"] == rec["rows"][0]["action tokens"]


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
