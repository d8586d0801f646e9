"""In-flight weight updates (both KV-cache options), stop strings / finish reasons, and the
worker's admission control."""


import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sao_jax.models.transformer import Transformer, default_positions, init_cache
from sao_jax.rollout.engine import SAOEngine
from sao_jax.rollout.staleness import AdmissionControl
from sao_jax.rollout.sync import WeightStore
from sao_jax.rollout.worker import RolloutWorker
from sao_jax.train.steps import token_logprobs

from rollout_fixtures import CFG, EchoEnv, P, Tok, full_logprobs  # noqa: E402  (tests/ is on sys.path)


def _setup(slots=1, temperature=1.0):
  model = Transformer(CFG, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model)
  params = nnx.to_pure_dict(params)
  engine = SAOEngine(CFG, graphdef, Tok(), max_concurrent_decodes=slots, max_prefill_length=16,
                     temperature=temperature, seed=0)
  return graphdef, params, engine


def _logits(graphdef, params, tokens, cache=None, start=0):
  model = nnx.merge(graphdef, params)
  t = jnp.asarray(tokens, jnp.int32)[None]
  pos = start + default_positions(t)
  return model(t, pos, cache)


def _run_across_update(kv_on_update):
  graphdef, params, engine = _setup()
  params2 = jax.tree.map(lambda x: x * 1.3, params)
  store = WeightStore(params, 0)
  out = []
  # no stop ids: turn 0 runs max_new_tokens=6 tokens, the env then answers (obs), turn 1 too.
  worker = RolloutWorker(engine, EchoEnv(), iter([P("0", [11, 12, 13])]),
                         lambda t: out.append(t) or True, store, stop_ids=(2,),
                         max_new_tokens=6, max_seq_len=CFG.max_seq_len, kv_on_update=kv_on_update)
  for _ in range(3):
    worker.step()
  store.publish(params2, 1)
  worker.run()
  assert len(out) == 1
  return graphdef, params, params2, out[0], worker


@pytest.mark.slow
@pytest.mark.parametrize("kv_on_update", ["keep", "recompute"])
def test_inflight_update_logprobs_match_the_weights_that_produced_each_token(kv_on_update):
  graphdef, params, params2, traj, worker = _run_across_update(kv_on_update)
  mask = traj.action_mask > 0
  versions = traj.policy_version[mask]
  assert set(versions.tolist()) == {0, 1}
  assert (np.diff(versions) >= 0).all()
  idx = np.nonzero(mask)[0]
  first_new = int(idx[versions == 1][0])
  tokens = traj.tokens
  full_old = np.asarray(token_logprobs(_logits(graphdef, params, tokens)[0], tokens[None]))[0]
  full_new = np.asarray(token_logprobs(_logits(graphdef, params2, tokens)[0], tokens[None]))[0]
  old = idx[versions == 0]
  new = idx[versions == 1]
  # tokens sampled before the update: the old weights over the whole (causal) prefix
  np.testing.assert_allclose(traj.logprobs[old], full_old[old], atol=1e-5)
  if kv_on_update == "recompute":
    assert worker.stats.kv_recomputes == 1
    np.testing.assert_allclose(traj.logprobs[new], full_new[new], atol=1e-5)
  else:
    assert worker.stats.kv_recomputes == 0
    # stale KV: positions < s were cached by the old weights, s onwards by the new ones
    s = first_new - 1
    cache = init_cache(CFG, 1, CFG.max_seq_len + 16)
    lo, cache = _logits(graphdef, params, tokens[:s], cache)
    hi, _ = _logits(graphdef, params2, tokens[s:], cache, start=s)
    mixed = np.asarray(token_logprobs(jnp.concatenate([lo, hi], 1), tokens[None]))[0]
    np.testing.assert_allclose(traj.logprobs[new], mixed[new], atol=1e-5)
    # ... which is not what the new weights compute from scratch (the KV really is stale)
    assert np.abs(traj.logprobs[new] - full_new[new]).max() > 1e-3


def test_stop_string_and_finish_reasons():
  graphdef, params, engine = _setup(slots=2, temperature=0.0)
  # greedy: find the first generated character, then use it as a stop string
  probe = []
  RolloutWorker(engine, EchoEnv(), iter([P("a", [11, 12])]), lambda t: probe.append(t) or True,
                WeightStore(params), stop_ids=(), max_new_tokens=4,
                max_seq_len=CFG.max_seq_len, temperature=0.0).run()
  assert probe[0].info["finish_reason"] == "max_new_tokens" and probe[0].truncated
  first = int(probe[0].tokens[3])
  stop = Tok().decode([first])
  out = []
  RolloutWorker(engine, EchoEnv(), iter([P("a", [11, 12])]), lambda t: out.append(t) or True,
                WeightStore(params), stop_ids=(), max_new_tokens=4, max_seq_len=CFG.max_seq_len,
                temperature=0.0, stop_strings=(stop,), max_turns=1).run()
  t = out[0]
  # the first sampled token ends turn 0 by stop string; max_turns=1 then ends the trajectory
  assert t.info["finish_reason"] == "max_turns" and t.truncated
  assert t.num_action_tokens == 1 and int(t.tokens[3]) == first
  out2 = []
  RolloutWorker(engine, EchoEnv(), iter([P("a", [11, 12])]), lambda t: out2.append(t) or True,
                WeightStore(params), stop_ids=(), max_new_tokens=4, max_seq_len=CFG.max_seq_len,
                temperature=0.0, stop_strings=(stop,)).run()
  # turn 0 ended by the stop string after one token, so the observation follows it directly
  assert out2[0].num_turns == 2 and out2[0].tokens[4:8].tolist() == [6, 7, 8, 9]
  turn1 = out2[0].tokens[8:]
  ended_by_string = Tok().decode(turn1.tolist()).endswith(stop)
  assert out2[0].info["finish_reason"] == ("stop_string" if ended_by_string else "max_new_tokens")
  assert out2[0].truncated == (not ended_by_string)
  # max_seq_len: the trajectory stops at the model's length limit
  out3 = []
  RolloutWorker(engine, EchoEnv(), iter([P("a", [11, 12])]), lambda t: out3.append(t) or True,
                WeightStore(params), stop_ids=(), max_new_tokens=40, max_seq_len=10,
                temperature=0.0).run()
  assert out3[0].info["finish_reason"] == "max_length" and len(out3[0].tokens) == 10


@pytest.mark.slow
def test_worker_admission_control_caps_rollouts_started_ahead_of_the_trainer():
  """eta=1, B=2: with the trainer stuck at version 0 at most (1 + 1) * 2 = 4 rollouts start."""
  _, params, engine = _setup(slots=3)
  adm = AdmissionControl(max_staleness=1, batch_size=2)
  out = []
  problems = iter([P(str(i), [11, 12 + i]) for i in range(20)])
  worker = RolloutWorker(engine, EchoEnv(), problems, lambda t: out.append(t) or True,
                         WeightStore(params), stop_ids=(2,), max_new_tokens=3,
                         max_seq_len=CFG.max_seq_len, admission=adm)
  for _ in range(40):
    worker.step()
  assert len(out) == 4 and adm.accepted == 4 and adm.running == 0
  assert worker.stats.admission_waits > 0
  # the trainer moves to version 1: two more may start
  worker.weights.publish(params, 1)
  for _ in range(40):
    worker.step()
  assert len(out) == 6 and adm.accepted == 6


ALL_IDS = tuple(range(CFG.vocab_size))  # every token ends its turn: one-token turns
THIRD_IDS = tuple(range(2, CFG.vocab_size, 3))  # a third of the ids end a turn
SLOW_T = 100.0  # sampling temperature of the slow-tool runs: near-uniform


class SlowToolEnv(EchoEnv):
  """EchoEnv whose turn-0 step (the tool call) sleeps ``delay[problem id]`` seconds; ``windows``
  records each sleep's (start, end) ``perf_counter`` times by problem id."""

  def __init__(self, delay):
    self.delay = delay
    self.windows = {}

  def step(self, p, turn, action_ids):
    if turn == 0 and p.id in self.delay:
      start = time.perf_counter()
      time.sleep(self.delay[p.id])
      self.windows[p.id] = (start, time.perf_counter())
    return super().step(p, turn, action_ids)


def _slow_run(env_workers, slow_s, n=7, slots=3):
  """Problem "slow" (slot 0) waits ``slow_s`` on its tool call; the others do not. Near-uniform
  sampling (temperature ``SLOW_T``) with every third token id a stop token gives turns of a few
  tokens, so other slots keep decoding (generate steps) while "slow" waits. (At temperature 3
  the random model repeats its last token: over 12 seeds 2-8 of each run's 8 trajectories hit
  max_new_tokens=30 without a stop, with either sampler, so "slow" reached its tool call only by
  its seed's luck; at 100, 0 of 64 did.)"""
  graphdef, params, engine = _setup(slots=slots, temperature=SLOW_T)
  problems = [P("warm", [11, 12, 13])] + [P(str(i), [11, 12, 13]) for i in range(n)]
  # warm-up rollouts (compile prefill / generate / insert) so that timings below are decode
  # only: one problem, then one per slot, so the multi-row prefills of admissions and of
  # observations answered together (1 .. slots rows) are compiled too
  for warm in (problems[:1], problems[:slots]):
    RolloutWorker(engine, EchoEnv(), iter(warm), lambda t: True, WeightStore(params),
                  stop_ids=THIRD_IDS, max_new_tokens=30, max_seq_len=CFG.max_seq_len).run()
  out, times = [], {}
  problems = [P("slow", [11, 12, 13])] + problems[1:]

  def sink(t):
    out.append(t)
    times[t.problem_id] = time.perf_counter()
    return True

  env = SlowToolEnv({"slow": slow_s})
  worker = RolloutWorker(engine, env, iter(problems), sink,
                         WeightStore(params), stop_ids=THIRD_IDS, max_new_tokens=30,
                         max_seq_len=CFG.max_seq_len, seed=3, env_workers=env_workers)
  t0 = time.perf_counter()
  worker.run()
  assert len(out) == n + 1
  window = tuple(w - t0 for w in env.windows["slow"])
  return graphdef, params, out, {k: v - t0 for k, v in times.items()}, window, worker


@pytest.mark.slow
def test_slow_tool_call_does_not_stop_other_slots_with_env_workers():
  """SAO's rollout with env.step off the decode loop: while "slow" waits 2 s on its tool call,
  its two slot neighbours finish and the remaining problems run through those two slots; "slow"
  lands last. Its continuation (prefilled at its true length onto its slot's KV cache, while its
  slot position kept decoding discarded tokens past that length) has the log-probs of a full
  forward pass."""
  graphdef, params, out, done_at, (start, end), worker = _slow_run(env_workers=3, slow_s=2.0)
  assert out[-1].problem_id == "slow" and done_at["slow"] >= end >= start + 2.0
  # trajectories land while the tool call is in flight (measured against the call's own window,
  # not the run's start, so a loaded machine that reaches the call late does not fail the test)
  assert sum(start < v < end for k, v in done_at.items() if k != "slow") >= 2
  assert worker.stats.env_slot_steps > 0  # generate steps ran while "slow" waited
  slow = out[-1]
  obs = np.nonzero(slow.action_mask[4:] == 0)[0] + 4  # after the prompt: the observation
  assert slow.num_turns == 2 and slow.tokens[obs].tolist() == [6, 7, 8, 9]
  for traj, full in zip(out, full_logprobs(graphdef, params, out, SLOW_T)):
    mask = traj.action_mask > 0
    np.testing.assert_allclose(traj.logprobs[mask], full[mask], atol=1e-5)


@pytest.mark.slow
def test_inline_env_step_blocks_every_slot():
  """Contrast (env_workers=0, the deterministic default): the slow tool call stops decoding for
  all slots, so no trajectory lands while it is in flight."""
  _, _, out, done_at, (start, end), _ = _slow_run(env_workers=0, slow_s=1.0, n=4)
  assert end >= start + 1.0 and len(done_at) == 5
  assert not any(start < v < end for v in done_at.values())


@pytest.mark.slow
def test_kv_recompute_applies_to_a_slot_waiting_on_its_env():
  """kv_on_update="recompute" + a weight update while the slot's tool call is in flight: the
  waiting slot's KV cache is recomputed too, so the tokens after the tool call have exactly the new
  weights' full-forward log-probs."""
  graphdef, params, engine = _setup(slots=1)
  params2 = jax.tree.map(lambda x: x * 1.3, params)
  store, out = WeightStore(params, 0), []
  worker = RolloutWorker(engine, SlowToolEnv({"0": 0.5}), iter([P("0", [11, 12, 13])]),
                         lambda t: out.append(t) or True, store, stop_ids=ALL_IDS,
                         max_new_tokens=4, max_seq_len=CFG.max_seq_len, kv_on_update="recompute",
                         env_workers=1)
  while not worker._pending:  # pylint: disable=protected-access
    worker.step()
  store.publish(params2, 1)
  worker.run()
  traj = out[0]
  assert worker.stats.kv_recomputes == 1
  new = np.nonzero((traj.action_mask > 0) & (traj.policy_version == 1))[0]
  assert new.tolist() == [9]  # turn 1's token, sampled after the observation
  full_new = np.asarray(token_logprobs(_logits(graphdef, params2, traj.tokens)[0],
                                       traj.tokens[None]))[0]
  np.testing.assert_allclose(traj.logprobs[new], full_new[new], atol=1e-5)


def test_env_workers_auto_follows_the_tool_latency_and_eval_runs_without_it():
  from configs import arith_tool
  from sao_jax import roles, tasks
  from sao_jax.rollout.worker import env_workers_for
  c = arith_tool.get_config("smoke")
  run = lambda: roles.from_config(c)
  assert env_workers_for(run()) == 0  # the default task: inline env.step, as before
  c.task.tool_latency_median_s = 0.2
  assert env_workers_for(run()) == c.rollout.slots
  c.rollout.env_workers = 2
  assert env_workers_for(run()) == 2
  task = tasks.make_task(run())
  assert task.env.tool_latency_median_s == 0.2 and task.env.tool_latency_sigma == 1.0
  assert task.eval_env is not None and task.eval_env.tool_latency_median_s == 0.0
  smoke = roles.from_config(arith_tool.get_config("smoke"))
  assert tasks.make_task(smoke).eval_env is None


class _Recording:
  """An engine proxy that records each ``prefill_insert`` call's slots and starts; with
  ``jetstream_only`` it hides ``prefill_insert`` / ``generate_steps`` (the JetStream-API path:
  one prefill per prompt or observation)."""

  def __init__(self, engine, jetstream_only=False, tokenizer=None):
    self._engine, self._hidden, self.calls = engine, jetstream_only, []
    self.tokenizer = tokenizer or engine.tokenizer

  def prefill_insert(self, params, state, slots, prompts, **kw):
    self.calls.append((list(slots), list(kw.get("starts") or [0] * len(slots))))
    return self._engine.prefill_insert(params, state, slots, prompts, **kw)

  def __getattr__(self, name):
    if self._hidden and name in ("prefill_insert", "generate_steps"):
      raise AttributeError(name)
    return getattr(self._engine, name)


class _AllX(Tok):
  def decode(self, ids):
    return "x" * len(list(ids))


def test_observations_answered_together_are_prefilled_in_one_call():
  """4 slots, greedy; every token decodes to "x" and "xxx" is the stop string, so every turn
  ends at its third token, all in the same step: the 4 observations go into one
  ``prefill_insert`` (as the 4 prompts do). The trajectories are the JetStream-API path's (one
  prefill per slot): tokens equal, log-probs within 1e-5."""
  _, params, engine = _setup(slots=4, temperature=0.0)
  problems = [P(str(k), [11 + k, 12, 13 + 2 * k]) for k in range(4)]

  def rollout(eng):
    out = []
    RolloutWorker(eng, EchoEnv(), iter(problems), lambda t: out.append(t) or True,
                  WeightStore(params), stop_ids=(), stop_strings=("xxx",), max_new_tokens=8,
                  max_seq_len=CFG.max_seq_len, temperature=0.0).run()
    return sorted(out, key=lambda t: t.problem_id)

  batched = _Recording(engine, tokenizer=_AllX())
  ours = rollout(batched)
  ref = rollout(_Recording(engine, jetstream_only=True, tokenizer=_AllX()))
  # the prompts together, then the 4 observations (pending token at position 4 = prompt + 3 - 0)
  assert batched.calls == [([0, 1, 2, 3], [0, 0, 0, 0]), ([0, 1, 2, 3], [6, 6, 6, 6])]
  assert [t.problem_id for t in ours] == ["0", "1", "2", "3"]
  for a, b in zip(ours, ref):
    assert a.tokens.tolist() == b.tokens.tolist() and a.num_turns == b.num_turns == 2
    np.testing.assert_array_equal(a.action_mask, b.action_mask)
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    assert a.tokens[7:11].tolist() == [6, 7, 8, 9]  # prompt 4 + 3 actions, then the observation
    assert len(a.tokens) == 14 and a.info["finish_reason"] == "stop_string"
