"""Staleness control: AReaL admission rule, the drop-on-arrival rule, bounded queue under a
long-tailed length distribution and the length bias of dropping (the simulation of
``experiments/staleness_lengths.py``), and flat memory over 10,000 trajectories. The take loop
that applies both policies is tested in ``test_assembler.py``."""

import repo_paths  # tests/repo_paths.py
import os
import sys
import threading
import tracemalloc

import numpy as np
import pytest

from sao_jax.rollout.staleness import AdmissionControl, check_policy, is_too_stale
from sao_jax.rollout.sync import TrajectoryQueue
from sao_jax.rollout.trajectory import Trajectory

sys.path.insert(0, os.path.join(repo_paths.ROOT, "experiments"))
from staleness_lengths import length_histogram, simulate  # noqa: E402


def _traj(versions, n_prompt=2):
  v = np.concatenate([np.full(n_prompt, -1), np.asarray(versions)]).astype(np.int32)
  mask = (v >= 0).astype(np.float32)
  return Trajectory("", np.zeros(len(v), np.int32), mask, np.zeros(len(v), np.float32), v, 0.0)


def test_admission_rule_hand_worked():
  a = AdmissionControl(max_staleness=1, batch_size=2)  # budget (v + 2) * 2
  assert [a.try_start(0) for _ in range(5)] == [True] * 4 + [False]
  a.finish(True), a.finish(True)
  assert not a.try_start(0)          # accepted 2 + running 2 = 4 = (0 + 2) * 2
  assert a.capacity(1) == 2 and a.try_start(1) and a.try_start(1) and not a.try_start(1)
  a.finish(False)                    # a failed rollout frees its place
  assert a.try_start(1)
  a.revoke()                         # a dropped rollout too
  assert a.accepted == 1 and a.try_start(1)
  with pytest.raises(ValueError, match="max_staleness"):
    AdmissionControl(-1, 2)
  with pytest.raises(ValueError, match="staleness_policy"):
    check_policy("fifo", 2)


def test_drop_on_arrival_rule():
  t = _traj([3, 3, 4])  # oldest action token: version 3
  assert not is_too_stale(t, 5, 2) and is_too_stale(t, 6, 2)
  assert not is_too_stale(_traj([]), 100, 0)  # no action tokens: never stale


LENGTHS = np.clip(np.round(np.random.default_rng(0).lognormal(3.0, 1.0, 20000)), 1, 1000)


@pytest.mark.parametrize("policy", ["drop", "admission+drop", "admission", "none"])
def test_long_tail_queue_bound_and_staleness(policy):
  r = simulate(policy, 1 if policy != "none" else None, lengths=LENGTHS.astype(int), slots=32,
               batch_size=16, queue_size=24, train_ticks=20, steps=100)
  assert r.steps == 100 and r.max_queue <= 24
  gen, trained = np.mean(r.generated_lengths), np.mean(r.trained_lengths)
  print(f"{policy}: generated {len(r.generated_lengths)} mean len {gen:.1f}; trained "
        f"{len(r.trained_lengths)} mean len {trained:.1f}; max token staleness "
        f"{r.max_token_staleness}; dropped {r.dropped}")
  if "drop" in policy:
    assert r.max_token_staleness <= 1
    # dropping the stale (= long) rollouts biases training toward short responses
    assert trained < 0.8 * gen and r.dropped > 0
    edges = [1, 8, 16, 32, 64, 128, 1001]
    assert length_histogram(r.trained_lengths, edges)[-1] < length_histogram(
        r.generated_lengths, edges)[-1]
  if "admission" in policy:
    assert r.max_running <= 32
  if policy == "none":
    assert r.max_token_staleness > 1


def test_ten_thousand_trajectories_keep_memory_flat():
  q = TrajectoryQueue(32)
  stop = threading.Event()
  n = 10_000

  def produce():
    rng = np.random.default_rng(0)
    for _ in range(n):
      q.put(_traj(np.zeros(int(rng.integers(1, 16)), np.int32)), stop)

  tracemalloc.start()
  t = threading.Thread(target=produce, daemon=True)
  t.start()
  mem, max_q = {}, 0
  for i in range(1, n + 1):
    q.get(timeout=30)
    max_q = max(max_q, q.qsize())
    if i in (1000, n):
      mem[i] = tracemalloc.get_traced_memory()[0]
  t.join(10)
  peak = tracemalloc.get_traced_memory()[1]
  tracemalloc.stop()
  print(f"10k trajectories: traced memory {mem[1000] / 1e3:.0f} kB after 1k, "
        f"{mem[n] / 1e3:.0f} kB after 10k, peak {peak / 1e3:.0f} kB; max queue {max_q}")
  assert q.num_put == n and max_q <= 32 and q.max_seen <= 32
  assert mem[n] - mem[1000] < 200_000  # no growth with the number of trajectories
