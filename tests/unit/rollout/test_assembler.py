"""The one take loop (``rollout/assembler.py:BatchAssembler``): groups, drop-on-arrival, ledger
consumption, admission revocation, length statistics and metric names, hand-worked on a scripted
rollout (``rollout_fixtures.scripted_trajectory``: no model, so no noise); and the thread and the
Ray backends, both run on that script, give the same accounting.

The script (policy versions per ledger position and group member; 1 + (p + member) % 3 action
tokens), with groups of 2, batches of 4, ``admission+drop`` at eta = 1 and a publish after each
take, gives by hand:

  take at v | arrivals (position: versions)     | dropped (v - oldest > 1) | batch positions
  0         | 0: (0, 0), 1: (0, 0)              | -                        | 0 0 1 1
  1         | 2: (0, 0), 3: (1, 1)              | -                        | 2 2 3 3
  2         | 4: (0, 1), 5: (2, 2), 6: (1, 2)   | 4 (2 - 0 = 2)            | 5 5 6 6
  3         | 7: (1, 1), 8: (2, 1), 9, 10       | 7, 8 (member 1 only)     | 9 9 10 10

22 arrivals, 16 trained, 6 dropped (3 positions); response lengths: generated 44 / 22 = 2.0,
trained 30 / 16 = 1.875, dropped 14 / 6; every position 0..10 consumed once (ledger low = 11).
"""

import repo_paths  # tests/repo_paths.py
import json
import os
import time

import numpy as np
import pytest

from sao_jax import roles
from sao_jax.data.jsonl import Problem
from sao_jax.rollout.assembler import BatchAssembler
from sao_jax.rollout.ledger import PromptLedger

import rollout_fixtures as F  # noqa: E402  pylint: disable=wrong-import-position

ROOT = repo_paths.ROOT
PROBLEMS = [Problem(f"p{i}", "x", "1") for i in range(64)]
POLICY = dict(batch_size=4, group_size=2, staleness_policy="admission+drop", max_staleness=1)
EXPECTED = {
    "positions": [[0, 0, 1, 1], [2, 2, 3, 3], [5, 5, 6, 6], [9, 9, 10, 10]],
    "staleness": [[0, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 0]],
    "trained_lengths": [[1, 2, 2, 3], [3, 1, 1, 2], [3, 1, 1, 2], [1, 2, 2, 3]],
    "dropped_lengths": [2, 3, 2, 3, 3, 1],
    "ledger_state": {"low": 11, "extra": [], "seed": 0},
    "ledger_jsonl": [[1, [0, 1]], [2, [2, 3]], [3, [5, 6]], [4, [9, 10]]],
    "metrics": {"dropped_stale": 6.0, "response_tokens_generated_mean": 2.0,
                "response_tokens_trained_mean": 1.875,
                "response_tokens_dropped_mean": pytest.approx(14 / 6)},
}
TAKE_METRICS = {"wait_s", "queue_age_s", "dropped_stale", "response_tokens_generated_mean",
                "response_tokens_trained_mean", "response_tokens_dropped_mean"}


def _accounting(take, publish, ledger, metrics, run_dir) -> dict:
  """Four takes at versions 0..3 (a publish after each); what the hand-worked table lists."""
  batches = []
  for v in range(4):
    batches.append((v, take(4, v)))
    publish(v + 1)
  m = metrics()
  assert TAKE_METRICS <= set(m)
  with open(os.path.join(run_dir, "ledger.jsonl"), encoding="utf-8") as f:
    lines = [json.loads(x) for x in f]
  return {
      "positions": [[t.prompt_position for t in b] for _, b in batches],
      "staleness": [[v - t.oldest_version() for t in b] for v, b in batches],
      "trained_lengths": [[t.num_action_tokens for t in b] for _, b in batches],
      "ledger_state": ledger.state(),
      "ledger_jsonl": [[x["step"], x["positions"]] for x in lines],
      "metrics": {k: m[k] for k in EXPECTED["metrics"]},
  }


# ---- the assembler alone ------------------------------------------------------------------------
def test_assembler_groups_drop_and_revocation_hand_worked(tmp_path):
  """The table above through a transport written inline: admission asked before each hand-out
  (budget (v + 2) * 4), told on arrival; each dropped member revoked."""
  ledger = PromptLedger(PROBLEMS, seed=0)
  asm = BatchAssembler(ledger, run_dir=str(tmp_path), **POLICY)
  members = F._Members()  # pylint: disable=protected-access
  state = {"version": 0, "handed": 0}

  def next_arrival():
    assert asm.admission.try_start(state["version"])
    h = next(asm.problems)
    state["handed"] += 1
    asm.admission.finish(accepted=True)
    return F.scripted_trajectory(h, members(h)), 0.0

  accepted = []

  def take(n, v):
    out = asm.take(n, v, next_arrival)
    accepted.append(asm.admission.accepted)
    return out

  got = _accounting(take, lambda v: state.update(version=v), ledger, asm.metrics, str(tmp_path))
  assert got == {k: v for k, v in EXPECTED.items() if k != "dropped_lengths"}
  assert asm.lengths.dropped == EXPECTED["dropped_lengths"]
  # accepted = arrivals so far - dropped members revoked: 4, 8, 14 - 2, 22 - 6
  assert accepted == [4, 8, 12, 16] and state["handed"] == 22
  assert asm.admission.running == 0 and asm.collector.pending == 0


def test_assembler_barrier_refusals_and_a_stale_member_drops_its_group():
  ledger = PromptLedger(PROBLEMS, seed=0)
  asm = BatchAssembler(ledger, batch_size=2, synchronous=True)
  assert [getattr(next(asm.problems), "position", None) for _ in range(3)] == [0, 1, None]
  asm.published(1)
  assert [getattr(next(asm.problems), "position", None) for _ in range(3)] == [2, 3, None]
  # one stale member (version 0 at trainer version 2, eta 1) drops the whole group
  asm = BatchAssembler(PromptLedger(PROBLEMS, seed=0), batch_size=2, group_size=2,
                       staleness_policy="drop", max_staleness=1)
  h = next(asm.problems)
  unit = [F.scripted_trajectory(h, 0), F.scripted_trajectory(h, 1)]
  for t, v in zip(unit, (2, 0)):
    t.policy_version[t.action_mask > 0] = v
  assert asm.is_stale(unit, 2) and not asm.is_stale(unit[:1], 2) and not asm.is_stale(unit, 1)
  assert asm.admission is None
  with pytest.raises(ValueError, match="multiple of train.group_size=2"):
    asm.take(3, 0, lambda: None)
  with pytest.raises(ValueError, match="rollout.lockstep=True .* rollout.staleness_policy='drop'"):
    BatchAssembler(ledger, batch_size=2, staleness_policy="drop", max_staleness=1, lockstep=True)
  with pytest.raises(ValueError, match="needs rollout.max_staleness >= 0"):
    BatchAssembler(ledger, batch_size=2, staleness_policy="admission")
  with pytest.raises(ValueError, match="train.group_size=0"):
    BatchAssembler(ledger, batch_size=2, group_size=0)


# ---- both backends on the script ----------------------------------------------------------------
def _thread_accounting(monkeypatch, run_dir) -> dict:
  from sao_jax.rollout import source  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(source, "RolloutWorker", F.ScriptedWorker)
  ledger = PromptLedger(PROBLEMS, seed=0)
  src = source.ThreadSource(None, None, ledger, {"w": np.zeros(2, np.float32)}, 0, stop_ids=(),
                            max_new_tokens=4, max_seq_len=16, temperature=1.0, queue_size=8,
                            run_dir=run_dir, **POLICY)
  try:
    got = _accounting(src.take, lambda v: src.publish({"w": np.full(2, v, np.float32)}, v),
                      ledger, src.metrics, run_dir)
  finally:
    src.close()
  assert src.lengths.dropped == EXPECTED["dropped_lengths"]
  # every finished rollout was accepted, each dropped member revoked
  assert src.assembler.admission.accepted == src.worker.stats.trajectories - 6
  return got


def test_thread_backend_accounting_hand_worked(monkeypatch, tmp_path):
  got = _thread_accounting(monkeypatch, str(tmp_path))
  assert got == {k: v for k, v in EXPECTED.items() if k != "dropped_lengths"}


def _ray_processes() -> set:
  from test_ray_source import _ray_processes as live  # pylint: disable=import-outside-toplevel
  return live()


@pytest.fixture
def local_ray():
  """A Ray of 2 CPUs on 127.0.0.1 whose workers import ``tests/rollout_fixtures``; stopped at
  the end, with no raylet / gcs_server left."""
  ray = pytest.importorskip("ray")
  from sao_jax.rollout.ray_local import init_ray  # pylint: disable=import-outside-toplevel
  before = _ray_processes()
  env = {"PYTHONPATH": f"{ROOT}:{os.path.join(ROOT, 'tests')}",
         "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false", "JAX_PLATFORMS": "cpu"}
  assert init_ray(num_cpus=2, log_to_driver=False, object_store_memory=100 * 1024 ** 2,
                  runtime_env={"env_vars": env}) == "127.0.0.1"
  try:
    yield ray
  finally:
    ray.shutdown()
    deadline = time.time() + 60  # a loaded host can take > 20 s
    while _ray_processes() - before and time.time() < deadline:
      time.sleep(0.5)
    assert not _ray_processes() - before, "a raylet / gcs_server outlived ray.shutdown()"


@pytest.mark.slow
def test_ray_backend_equals_thread_backend(local_ray, monkeypatch, tmp_path):
  """One scripted Ray actor (arrivals in hand-out order, as the thread worker's queue) through
  ``RaySource``: the same batches, drops, staleness, ledger and metric values as the thread
  backend and the hand-worked table."""
  from sao_jax.rollout import ray_source  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(ray_source, "RolloutActor", F.ScriptedActor)
  config = roles.from_config({"rollout": {
      "num_workers": 1, "slots": 2, "ray_num_cpus": 0.5, "ray_max_outstanding": 4,
      "queue_size": 8, "weight_sync": "object_store"}})
  ledger = PromptLedger(PROBLEMS, seed=0)
  ray_dir = tmp_path / "ray"
  ray_dir.mkdir()
  src = ray_source.RaySource(config, None, ledger, {"w": np.zeros(2, np.float32)}, 0,
                             run_dir=str(ray_dir), **POLICY)
  try:
    got = _accounting(src.take, lambda v: src.publish({"w": np.full(2, v, np.float32)}, v),
                      ledger, src.metrics, str(ray_dir))
    m = src.metrics()
    returned = len(src.returned)
  finally:
    src.close()
  assert src.lengths.dropped == EXPECTED["dropped_lengths"]
  assert m["ray/duplicates"] == 0 and m["ray/restarts"] == 0 and m["ray/reissued"] == 0
  assert src.admission.accepted == returned - 6
  thread_dir = tmp_path / "thread"
  thread_dir.mkdir()
  assert got == _thread_accounting(monkeypatch, str(thread_dir))
  assert got == {k: v for k, v in EXPECTED.items() if k != "dropped_lengths"}
