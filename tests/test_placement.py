"""8 forced CPU devices: the engine on 4, the trainer on 4; weights sync by resharding and the
engine keeps generating while the trainer trains."""

import pytest
import json
import os
import subprocess
import sys

from conftest import with_test_xla_flags  # tests/conftest.py

pytestmark = pytest.mark.slow  # every test here is slow (see pyproject's `slow` marker)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_engine_and_trainer_on_disjoint_submeshes():
  env = dict(os.environ, XLA_FLAGS=with_test_xla_flags("--xla_force_host_platform_device_count=8"),
             JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "scripts", "submesh_sync.py")],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  r = json.loads(proc.stdout.strip().splitlines()[-1])
  print(r)
  assert r["engine_devices"] == [0, 1, 2, 3] and r["trainer_devices"] == [4, 5, 6, 7]
  assert r["decode_state_devices"] == [0, 1, 2, 3]
  assert r["store_version"] == 5 and r["engine_version"] >= 4 and r["worker_error"] == "None"
  # weights published after each step reached the engine: later batches carry newer versions
  assert max(r["versions_seen"]) >= 1
  # the engine generated while the trainer trained (wall-clock intervals intersect)
  assert r["overlap_s"] > 0 and r["generate_steps_during_training"] >= 1
