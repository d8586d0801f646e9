"""The learner-side ``Batch`` (hand-worked layout; each malformed trajectory refused naming the
trajectory and the field, before anything reaches a device) and the ``ThreadSource`` (exactly-once
ledger, GRPO groups by position, the drop policy's generated / trained / dropped lengths)."""

import time

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sao_jax.data.jsonl import Problem
from sao_jax.models.transformer import Transformer, default_positions
from sao_jax.rollout.engine import SAOEngine
from sao_jax.rollout.ledger import PromptLedger
from sao_jax.rollout.source import ThreadSource
from sao_jax.rollout.trajectory import Trajectory
from sao_jax.train.batch import BatchError, build_batch
from sao_jax.train.steps import token_logprobs

from rollout_fixtures import CFG, Step, Tok  # noqa: E402  pylint: disable=wrong-import-position


def _traj(n=6, **kw):
  act = np.array([0, 0, 1, 1, 0, 1][:n], np.float32)
  fields = dict(problem_id="q7", tokens=np.arange(3, 3 + n, dtype=np.int32), action_mask=act,
                logprobs=np.where(act > 0, -0.5, 0.0).astype(np.float32),
                policy_version=np.where(act > 0, 4, -1).astype(np.int32), reward=1.0)
  fields.update(kw)
  return Trajectory(**fields)


def test_batch_layout_hand_worked():
  """Two rows of one group (position 3) and one of its own; 2 empty padding rows; reward on
  the last action token only."""
  a, b = _traj(prompt_position=3), _traj(prompt_position=3, reward=0.0)
  c = _traj(n=4, prompt_position=9, truncated=True)
  batch = build_batch([a, b, c], pad_id=0, length=8, rows=5, vocab_size=32)
  assert batch.tokens.shape == (5, 8) and batch.action_mask.dtype == bool
  assert batch.group_id.tolist() == [0, 0, 1, -1, -1]
  assert batch.last_action.tolist() == [5, 5, 3, -1, -1]
  assert batch.last_index.tolist() == [5, 5, 3, 0, 0]
  assert batch.truncated.tolist() == [False, False, True, False, False]
  assert batch.policy_version[0].tolist() == [-1, -1, 4, 4, -1, 4, -1, -1]
  assert batch.tokens[2].tolist() == [3, 4, 5, 6, 0, 0, 0, 0]
  rewards = np.asarray(batch.token_rewards())
  assert rewards[0].tolist() == [0, 0, 0, 0, 0, 1, 0, 0] and rewards[1].sum() == 0
  assert rewards[2].tolist() == [0, 0, 0, 1, 0, 0, 0, 0] and rewards[3:].sum() == 0


_R = "Trajectory.reward for trajectory 1 (prompt 'q7')"  # envs/guard.check_reward's message


@pytest.mark.parametrize("bad, field", [
    (dict(action_mask=np.ones(5, np.float32)), "'action_mask' has 5 entries but 'tokens' has 6"),
    (dict(logprobs=np.zeros(7, np.float32)), "'logprobs' has 7 entries"),
    (dict(policy_version=np.zeros(4, np.int32)), "'policy_version' has 4 entries"),
    (dict(tokens=np.array([3, 4, -5, 6, 7, 8], np.int32)), "'tokens'[2] = -5 is outside"),
    (dict(tokens=np.array([3, 4, 999, 6, 7, 8], np.int32)), "'tokens'[2] = 999 is outside"),
    (dict(policy_version=np.array([-1, -1, -1, 4, -1, 4], np.int32)),
     "'policy_version'[2] = -1 on an action token"),
    (dict(logprobs=np.array([0, 0, np.nan, -1, 0, -1], np.float32)), "'logprobs'"),
    (dict(reward=float("inf")), _R + " is inf, not finite"),
    (dict(reward=None), _R + " is NoneType None, not a real number"),
    (dict(reward="1.0"), _R + " is str '1.0', not a real number"),
    (dict(reward=np.ones(2)), _R + " has shape (2,), not one scalar per episode"),
])
def test_malformed_trajectory_is_refused_naming_it_and_the_field(bad, field):
  good = _traj()
  with pytest.raises(BatchError) as e:
    build_batch([good, _traj(**bad)], pad_id=0, length=8, vocab_size=32)
  assert "trajectory 1 (prompt 'q7')" in str(e.value) and field in str(e.value)


def test_too_long_and_too_many_are_refused():
  with pytest.raises(BatchError, match="more than the batch length 4"):
    build_batch([_traj()], pad_id=0, length=4)
  with pytest.raises(BatchError, match="do not fit a batch of 1 rows"):
    build_batch([_traj(), _traj()], pad_id=0, length=8, rows=1)
  with pytest.raises(BatchError, match="^no trajectories"):
    build_batch([], pad_id=0)


def test_scalar_rewards_of_any_numeric_type_are_stored_as_float32():
  rewards = [1, True, np.float64(0.25), np.array(-0.5, np.float32)]
  batch = build_batch([_traj(reward=r) for r in rewards], pad_id=0, length=8)
  assert batch.reward.tolist() == [1.0, 1.0, 0.25, -0.5] and batch.reward.dtype == np.float32


def test_incomplete_group_is_refused_naming_group_size():
  """grpo modes (group_size G > 1): a batch whose group (same prompt position) has other than G
  rows is refused -- its advantages would be normalised over part of a group."""
  whole = [_traj(prompt_position=3), _traj(prompt_position=3, reward=0.0)]
  batch = build_batch(whole, pad_id=0, length=8, group_size=2)
  assert batch.group_id.tolist() == [0, 0]
  with pytest.raises(BatchError, match=r"prompt position 9: a group of 1 trajectories \(rows "
                                       r"\[2\]\), but train.group_size=2"):
    build_batch(whole + [_traj(prompt_position=9)], pad_id=0, length=8, group_size=2)
  with pytest.raises(BatchError, match=r"trajectory 0 \(no prompt position\): a group of 1"):
    build_batch([_traj(), _traj()], pad_id=0, length=8, group_size=2)
  build_batch([_traj(), _traj()], pad_id=0, length=8)  # group_size 1: no check


# ---- ThreadSource -----------------------------------------------------------------------------
class _Env:
  """One turn: the prompt is 3 tokens, the episode ends at the first turn's end; reward 1."""
  max_turns = 1

  def prompt_ids(self, p):
    return [1, 10 + int(p.id[1:]) % 20, 11]

  def step(self, p, turn, action_ids):
    return Step([], True, 1.0, {})


def _source(problems, **kw):
  graphdef, params = nnx.split(Transformer(CFG, rngs=nnx.Rngs(0)))
  engine = SAOEngine(CFG, graphdef, Tok(), max_concurrent_decodes=4, max_prefill_length=8,
                     temperature=1.0)
  ledger = PromptLedger(problems, seed=0)
  args = dict(stop_ids=(2, 5), max_new_tokens=6, max_seq_len=CFG.max_seq_len, temperature=1.0,
              batch_size=4, queue_size=64)
  args.update(kw)
  return ledger, ThreadSource(engine, _Env(), ledger, nnx.to_pure_dict(params), 0, **args), params


@pytest.mark.slow
def test_groups_arrive_whole_and_every_prompt_is_consumed_once(tmp_path):
  problems = [Problem(f"p{i}", "x", "1") for i in range(50)]
  ledger, src, _ = _source(problems, group_size=2, run_dir=str(tmp_path))
  try:
    seen = []
    for version in range(3):
      trajs = src.take(4, version)
      assert len(trajs) == 4
      positions = [t.prompt_position for t in trajs]
      assert all(positions.count(p) == 2 for p in positions)  # whole pairs only
      seen += sorted(set(positions))
  finally:
    src.close()
  assert len(seen) == len(set(seen)) == 6  # no prompt twice
  assert ledger.low + len(ledger.consumed) >= 6
  lines = open(tmp_path / "ledger.jsonl").read().splitlines()
  assert len(lines) == 3


@pytest.mark.slow
def test_drop_policy_reports_generated_trained_and_dropped_lengths():
  """eta = 0 and a publish after every take: most queued rollouts arrive one version late and
  are dropped; the report keeps the three lengths apart."""
  problems = [Problem(f"p{i}", "x", "1") for i in range(400)]
  ledger, src, params = _source(problems, staleness_policy="drop", max_staleness=0)
  try:
    deadline = time.time() + 60
    while src.queue.qsize() < 12 and time.time() < deadline:  # rollouts queued at version 0,
      time.sleep(0.05)                                          # stale once version 1 is out
    for version in range(4):
      trajs = src.take(4, version)
      assert all(t.oldest_version() >= version for t in trajs)  # nothing staler than eta=0
      src.publish(nnx.to_pure_dict(params), version + 1)
    m = src.metrics()
  finally:
    src.close()
  assert m["dropped_stale"] > 0
  for key in ("response_tokens_generated_mean", "response_tokens_trained_mean",
              "response_tokens_dropped_mean"):
    assert 1.0 <= m[key] <= 6.0, (key, m[key])
  n_gen = len(src.lengths.generated)
  pending = src.assembler.collector.pending
  assert n_gen == len(src.lengths.trained) + len(src.lengths.dropped) + pending


@pytest.mark.slow
def test_lockstep_delay_samples_with_the_weights_of_version_minus_d_in_groups():
  """rollout.lockstep_delay = 2 with groups of 2: the batch trained at version v is sampled with
  the weights published at max(0, v - 2) -- the version recorded per token, and the recorded
  log-probs equal to that model's (each version is a different random model) -- and every
  group is two rollouts of one prompt."""
  problems = [Problem(f"p{i}", "x", "1") for i in range(40)]
  models = [nnx.to_pure_dict(nnx.split(Transformer(CFG, rngs=nnx.Rngs(v)))[1]) for v in range(6)]
  ledger, src, _ = _source(problems, group_size=2, lockstep=True, lockstep_delay=2)
  src._history = type(src._history)({0: models[0]})  # version 0 = models[0]
  try:
    for version in range(5):
      trajs = src.take(4, version)
      sampled_with = max(0, version - 2)
      assert {int(v) for t in trajs for v in t.policy_version if v >= 0} == {sampled_with}
      t = trajs[0]  # its log-probs are those of the weights of version ``sampled_with``
      model = nnx.merge(nnx.split(Transformer(CFG, rngs=nnx.Rngs(0)))[0], models[sampled_with])
      tokens = jnp.asarray(t.tokens)[None]
      logp = np.asarray(token_logprobs(model(tokens, default_positions(tokens))[0], tokens))[0]
      on = np.asarray(t.action_mask) > 0
      np.testing.assert_allclose(np.asarray(t.logprobs)[on], logp[on], atol=1e-4)
      positions = [t.prompt_position for t in trajs]
      assert all(positions.count(p) == 2 for p in positions)
      src.publish(models[version + 1], version + 1)
    assert sorted(src._history) == [3, 4, 5]  # d + 1 versions kept
  finally:
    src.close()
  with pytest.raises(ValueError, match="lockstep_delay"):
    _source(problems, lockstep_delay=1)
