"""JetStream engine: sampled log-probs equal the trainer's recomputation; multi-turn prefill onto
an existing KV cache equals a full forward pass; weight sync mid-trajectory records versions."""


import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sao_jax.models.transformer import Transformer, default_positions
from sao_jax.rollout.engine import SAOEngine
from sao_jax.rollout.jetstream_compat import engine_api
from sao_jax.rollout.sync import WeightStore
from sao_jax.rollout.worker import RolloutWorker
from sao_jax.train.steps import token_logprobs

from rollout_fixtures import CFG, P, Step, Tok  # noqa: E402  (tests/ is on sys.path)


class EchoEnv:
  """Two turns: after the first turn the env answers with 4 observation tokens."""
  max_turns = 2

  def prompt_ids(self, p):
    return [1] + p.prompt

  def step(self, p, turn, action_ids):
    if turn == 0:
      return Step([6, 7, 8, 9], False, 0.0, {})
    return Step([], True, float(len(action_ids)), {"tool_calls": 1})


def _setup(temperature=1.0, slots=4):
  model = Transformer(CFG, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model)
  params = nnx.to_pure_dict(params)
  engine = SAOEngine(CFG, graphdef, Tok(), max_concurrent_decodes=slots, max_prefill_length=16,
                     temperature=temperature, seed=0)
  return model, graphdef, params, engine


def test_engine_implements_jetstream_api():
  _, _, params, engine = _setup()
  assert isinstance(engine, engine_api.Engine)
  state = engine.init_decode_state()
  padded, n = engine.pad_to_bucket([1, 11, 12, 13])
  prefix = engine.prefill(params=params, padded_tokens=padded, true_length=n)
  state = engine.insert(prefix, state, 2)
  state, result = engine.generate(params, state)
  slot = result.get_result_at_slot(2)
  assert slot.tokens.shape == (1, 1) and int(slot.valid[0, 0]) == 1
  assert int(slot.lengths[0]) == 5  # 4 prompt tokens + the first sampled token now cached
  assert engine.build_tokenizer().eos_id == 2


def _recompute(model, traj, temperature):
  tokens = jnp.asarray(traj.tokens)[None]
  logits, _ = model(tokens, default_positions(tokens))
  return np.asarray(token_logprobs(logits, tokens, temperature))[0]


def test_multi_turn_rollout_logprobs_equal_recomputed():
  """Engine log-probs (with observation chunks prefilled onto the KV cache) match a full forward
  pass over the whole trajectory, at the sampling temperature."""
  model, _, params, engine = _setup(temperature=0.7)
  problems = [P(str(i), [10 + i, 11, 12 + i]) for i in range(6)]
  out = []
  worker = RolloutWorker(engine, EchoEnv(), iter(problems), lambda t: out.append(t) or True,
                         WeightStore(params), stop_ids=Tok.stop_ids, max_new_tokens=6,
                         max_seq_len=CFG.max_seq_len, seed=1)
  worker.run()
  assert len(out) == 6
  for traj in out:
    mask = traj.action_mask > 0
    assert traj.num_turns >= 1
    recomputed = _recompute(model, traj, 0.7)
    np.testing.assert_allclose(traj.logprobs[mask], recomputed[mask], atol=1e-5)
    assert (traj.policy_version[mask] == 0).all() and (traj.policy_version[~mask] == -1).all()
  # at least one trajectory had an observation in the middle
  assert any(((t.action_mask[:-1] == 0) & (np.arange(len(t.tokens) - 1) > 3)).any() for t in out)


def test_weight_update_mid_trajectory_records_versions():
  """A trajectory generated across a weight change carries both versions per token."""
  model, graphdef, params, engine = _setup(temperature=1.0, slots=1)
  params2 = jax.tree.map(lambda x: x * 1.5, params)
  store = WeightStore(params, 0)
  out = []
  worker = RolloutWorker(engine, EchoEnv(), iter([P("0", [11, 12])]), lambda t: out.append(t) or True,
                         store, stop_ids=(), max_new_tokens=8, max_seq_len=CFG.max_seq_len)
  for _ in range(3):
    worker.step()
  store.publish(params2, 1)
  worker.run()
  traj = out[0]
  versions = traj.policy_version[traj.action_mask > 0]
  assert set(versions.tolist()) == {0, 1}
  assert (np.diff(versions) >= 0).all()
  # each token's log-prob matches the weights that produced it... with the stale KV of earlier
  # tokens: the first version-0 tokens match a full forward pass under the old weights.
  rec0 = _recompute(model, traj, 1.0)
  first = np.nonzero(traj.action_mask)[0][:3]
  np.testing.assert_allclose(traj.logprobs[first], rec0[first], atol=1e-5)
