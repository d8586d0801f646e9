"""In-flight weight updates (both KV-cache options), stop strings / finish reasons, and the
worker's admission control."""


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

from rollout_fixtures import CFG, P, Step, Tok  # noqa: E402  (tests/ is on sys.path)


class EchoEnv:
  """Turn 0 is answered with 4 observation tokens; turn 1 ends the episode."""
  max_turns = 2

  def prompt_ids(self, p):
    return [1] + p.prompt

  def step(self, p, turn, action_ids):
    if turn == 0:
      return Step([6, 7, 8, 9], False, 0.0, {})
    return Step([], True, 1.0, {})


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
