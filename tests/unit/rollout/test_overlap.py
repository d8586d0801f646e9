"""``RolloutWorker(overlap_host=True)``: decode call N+1 is dispatched before the host reads call
N's tokens. Every recorded log-prob still equals a full causal forward pass of the final tokens,
every problem yields one trajectory, the calls really overlapped, and greedy rollouts give the
tokens of the default (non-overlapped) loop."""

import jax
import numpy as np
import pytest
from flax import nnx

from sao_jax.models.transformer import Transformer
from sao_jax.rollout.engine import SAOEngine
from sao_jax.rollout.sync import WeightStore
from sao_jax.rollout.worker import RolloutWorker

from rollout_fixtures import CFG, EchoEnv, P, Tok, full_logprobs  # noqa: E402  (tests/ is on sys.path)

STOPS = tuple(range(2, CFG.vocab_size, 3))  # every third id: turns of a few tokens, ending mid-call
T = 100.0  # sampling temperature: near-uniform, so turns end on stop tokens (-> an observation)
PROBLEMS = [P(str(k), [10 + k % 7, 12 + k % 3, 13]) for k in range(9)]


def _setup(slots=3, temperature=T):
  graphdef, params = nnx.split(Transformer(CFG, rngs=nnx.Rngs(0)))
  params = nnx.to_pure_dict(params)
  engine = SAOEngine(CFG, graphdef, Tok(), max_concurrent_decodes=slots, max_prefill_length=16,
                     temperature=temperature, seed=0)
  return graphdef, params, engine


def _rollout(engine, params, *, overlap, decode_steps, temperature=T, env_workers=0):
  """Rolls out PROBLEMS through EchoEnv (two turns). Returns (trajectories by problem id,
  worker)."""
  store = WeightStore(params, 0)
  out = []
  worker = RolloutWorker(engine, EchoEnv(), iter(PROBLEMS), lambda t: out.append(t) or True,
                         store, stop_ids=STOPS, max_new_tokens=6, max_seq_len=CFG.max_seq_len,
                         temperature=temperature, seed=0, decode_steps=decode_steps,
                         env_workers=env_workers, overlap_host=overlap)
  worker.run()
  assert sorted(t.problem_id for t in out) == sorted(p.id for p in PROBLEMS)  # one each
  return {t.problem_id: t for t in out}, worker


@pytest.mark.parametrize("decode_steps,env_workers", [
    (1, 0), pytest.param(4, 0, marks=pytest.mark.slow), (4, 2)])
def test_overlapped_rollout_logprobs_match_a_full_forward(decode_steps, env_workers):
  graphdef, params, engine = _setup()
  trajs, worker = _rollout(engine, params, overlap=True, decode_steps=decode_steps,
                           env_workers=env_workers)
  assert worker.stats.overlapped_calls > 0  # calls dispatched before the previous one was read
  assert worker.stats.tokens_discarded > 0  # slots decoded in a call dispatched past their turn
  trajs = list(trajs.values())
  assert sum(t.num_turns == 2 for t in trajs) >= 3  # observations prefilled mid-run
  for traj, full in zip(trajs, full_logprobs(graphdef, params, trajs, T)):
    mask = traj.action_mask > 0
    np.testing.assert_allclose(traj.logprobs[mask], full[mask], atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("kv_on_update", ["keep", "recompute"])
def test_overlapped_rollout_across_a_weight_update(kv_on_update):
  """A weight update mid-run reads the call in flight first: every token is labelled with the
  version that sampled it; with "recompute" each token's log-prob is its version's full forward
  (with "keep" the old version's tokens are, the new ones attend to stale KV)."""
  graphdef, params, engine = _setup()
  params2 = jax.tree.map(lambda x: x * 1.3, params)
  store = WeightStore(params, 0)
  out = []
  worker = RolloutWorker(engine, EchoEnv(), iter(PROBLEMS), lambda t: out.append(t) or True,
                         store, stop_ids=STOPS, max_new_tokens=6, max_seq_len=CFG.max_seq_len,
                         seed=0, decode_steps=4, kv_on_update=kv_on_update, overlap_host=True)
  for _ in range(4):
    worker.step()
  assert worker._inflight is not None  # pylint: disable=protected-access
  store.publish(params2, 1)
  worker.run()
  assert sorted(t.problem_id for t in out) == sorted(p.id for p in PROBLEMS)
  assert worker.stats.weight_updates == 1
  full_old = full_logprobs(graphdef, params, out, T)
  full_new = full_logprobs(graphdef, params2, out, T)
  seen = set()
  for traj, old, new in zip(out, full_old, full_new):
    mask = traj.action_mask > 0
    v = traj.policy_version[mask]
    seen |= set(v.tolist())
    assert (np.diff(v) >= 0).all()
    np.testing.assert_allclose(traj.logprobs[mask & (traj.policy_version == 0)],
                               old[mask & (traj.policy_version == 0)], atol=1e-5)
    if kv_on_update == "recompute":
      np.testing.assert_allclose(traj.logprobs[mask & (traj.policy_version == 1)],
                                 new[mask & (traj.policy_version == 1)], atol=1e-5)
  assert seen == {0, 1}


@pytest.mark.slow
@pytest.mark.parametrize("decode_steps", [1, 4])
def test_greedy_overlap_gives_the_default_tokens(decode_steps):
  """At temperature 0 no key is used, and a slot's tokens depend only on its own sequence, so
  overlapping (a slot rejoins one call later after each turn) changes no token. (Params x3:
  the random init's greedy turns then end on stop tokens, so every rollout has an observation.)"""
  _, params, engine = _setup(temperature=0.0)
  params = jax.tree.map(lambda x: x * 3.0, params)
  off, _ = _rollout(engine, params, overlap=False, decode_steps=decode_steps, temperature=0.0)
  on, worker = _rollout(engine, params, overlap=True, decode_steps=decode_steps, temperature=0.0)
  assert worker.stats.overlapped_calls > 0
  assert sum(t.num_turns == 2 for t in off.values()) >= 3
  for pid, traj in off.items():
    assert on[pid].tokens.tolist() == traj.tokens.tolist(), pid
    np.testing.assert_allclose(on[pid].logprobs, traj.logprobs, atol=1e-5)


def test_overlap_needs_generate_steps():
  class JetStreamOnly:  # the JetStream API without SAOEngine's batched calls
    cfg, max_concurrent_decodes = CFG, 1

    def init_decode_state(self, seed):
      return None

  with pytest.raises(ValueError, match="overlap_host"):
    RolloutWorker(JetStreamOnly(), EchoEnv(), iter([]), lambda t: True, WeightStore({}, 0),
                  stop_ids=(2,), max_new_tokens=4, max_seq_len=16, overlap_host=True)
