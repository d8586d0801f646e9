"""``SAOEngine`` on a 2-device mesh splits its slots over the ``data`` axis: every call draws the
same tokens and log-probs as the engine on one device, a multi-turn rollout gives the same
trajectories, and the decode step needs no communication between the devices."""

import repo_paths  # tests/repo_paths.py
import pytest
import json
import os
import subprocess
import sys

from conftest import with_test_xla_flags  # tests/conftest.py

pytestmark = pytest.mark.slow  # every test here is slow (see pyproject's `slow` marker)

ROOT = repo_paths.ROOT


def test_engine_split_over_two_devices_equals_one_device():
  env = dict(os.environ, XLA_FLAGS=with_test_xla_flags("--xla_force_host_platform_device_count=2"),
             JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "scripts",
                                                      "engine_data_parallel.py")],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  r = json.loads(proc.stdout.strip().splitlines()[-1])
  print(r)
  # seven calls of five kinds -- prefill_insert (fresh, uneven over the devices, explicit rows;
  # appended observations), generate_steps, generate, prefill + insert, slot_prefix + prefill +
  # insert -- at temperature 1 on a model flat enough to sample: the same tokens, log-probs
  # within 1e-5, the same KV cache
  assert r["tokens_equal"] == [True] * 7 and r["max_logprob_diff"] <= 1e-5
  assert r["explicit_mesh_tokens_equal"] == [True] * 7  # a mesh with Explicit axis types too
  assert r["lengths"][0] == r["lengths"][1] == r["host_lengths"][0] == r["host_lengths"][1]
  assert r["cache_spec"] == "P('data',)" and r["cache_devices"] == [0, 1]
  assert r["collectives"] == {"generate": [], "generate_steps": []}  # each device its own slots
  assert r["rollout_count"] == [12, 12] and r["rollout_tokens_equal"] == [True] * 12
  assert r["rollout_max_logprob_diff"] <= 1e-5
  assert "rollout.slots (max_concurrent_decodes)=3 must be a multiple" in r["bad_slots_error"]
  assert r["max_cache_diff"] <= 1e-5 and r["no_data_axis_tokens_equal"]
  assert r["distinct_decoded_tokens"] >= 10  # the toy model samples, it does not repeat a token
