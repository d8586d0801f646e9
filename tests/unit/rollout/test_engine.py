"""JetStream engine: sampled log-probs equal the trainer's recomputation; multi-turn prefill onto
an existing KV cache equals a full forward pass; weight sync mid-trajectory records versions."""


import jax
import pytest
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sao_jax.models.transformer import Transformer, default_positions
from sao_jax.rollout.engine import SAOEngine
from sao_jax.rollout.jetstream_compat import engine_api
from sao_jax.rollout.sync import WeightStore
from sao_jax.rollout.worker import RolloutWorker
from sao_jax.train.steps import token_logprobs

from rollout_fixtures import CFG, EchoEnv, P, Tok  # noqa: E402  (tests/ is on sys.path)


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


def test_fallback_api_matches_jetstream():
  """Without JetStream installed (a plain `pip install -e .`) jetstream_compat defines the API's
  base classes itself; they must match JetStream 0.2.2's: the same abstract methods, the same
  dataclass fields, the same tokenizer-parameter fields."""
  from sao_jax.rollout import jetstream_compat
  if not jetstream_compat.HAVE_JETSTREAM:
    pytest.skip("JetStream not installed: nothing to compare the fallback with")
  import dataclasses
  from jetstream.engine import engine_api as js_engine, tokenizer_api as js_tok, tokenizer_pb2
  ours_engine, ours_tok, ours_pb2 = jetstream_compat._fallback_modules()
  for ours, theirs in [(ours_engine.Engine, js_engine.Engine),
                       (ours_tok.Tokenizer, js_tok.Tokenizer)]:
    assert ours.__abstractmethods__ == theirs.__abstractmethods__, theirs
  for name in ("ResultTokens", "SlotData"):
    fields = lambda c: [(f.name, f.metadata.get("pytree_node", True))
                        for f in dataclasses.fields(c)]
    assert fields(getattr(ours_engine, name)) == fields(getattr(js_engine, name)), name
  assert (sorted(f.name for f in dataclasses.fields(ours_pb2.TokenizerParameters))
          == sorted(tokenizer_pb2.TokenizerParameters.DESCRIPTOR.fields_by_name))
  data = np.arange(12).reshape(4, 3)
  a = ours_engine.ResultTokens(data, (0, 1), (1, 2), (2, 3), 2).get_result_at_slot(1)
  b = js_engine.ResultTokens(data, (0, 1), (1, 2), (2, 3), 2).get_result_at_slot(1)
  for f in ("tokens", "valid", "lengths"):
    np.testing.assert_array_equal(getattr(a, f), getattr(b, f))


def _recompute(model, traj, temperature):
  tokens = jnp.asarray(traj.tokens)[None]
  logits, _ = model(tokens, default_positions(tokens))
  return np.asarray(token_logprobs(logits, tokens, temperature))[0]


@pytest.mark.slow
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


@pytest.mark.slow
def test_weight_update_mid_trajectory_records_versions():
  """A trajectory generated across a weight change carries both versions per token."""
  model, graphdef, params, engine = _setup(temperature=1.0, slots=1)
  params2 = jax.tree.map(lambda x: x * 1.5, params)
  store = WeightStore(params, 0)
  out = []
  worker = RolloutWorker(engine, EchoEnv(), iter([P("0", [11, 12])]),
                         lambda t: out.append(t) or True, store, stop_ids=(), max_new_tokens=8,
                         max_seq_len=CFG.max_seq_len)
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


def test_sample_tokens_draws_from_the_tempered_distribution():
  """40000 draws over a 300-token vocabulary (not a multiple of the 32-token block, so the tail
  is padded) at T = 0.8: Pearson's chi-square against softmax(logits / T) is below its 1e-6
  quantile, and against softmax(logits) (the wrong temperature) far above it, so the test can
  fail; tokens of probability 0 are never drawn; log-probs are those of the tempered
  distribution."""
  from scipy import stats  # pylint: disable=import-outside-toplevel
  from sao_jax.rollout.engine import sample_tokens  # pylint: disable=import-outside-toplevel
  logits = 2.0 * jax.random.normal(jax.random.key(0), (300,))
  logits = logits.at[jnp.asarray([0, 7, 150, 299])].set(-jnp.inf)
  keys = jax.random.split(jax.random.key(3), 40000)
  tokens, logprobs = jax.jit(jax.vmap(lambda k: sample_tokens(logits, k, 0.8)))(keys)
  tokens = np.asarray(tokens)
  counts = np.bincount(tokens, minlength=300)
  assert counts[[0, 7, 150, 299]].sum() == 0

  def chi2(p):  # bins with an expected count >= 5, the rest pooled into one bin
    expect = p * len(tokens)
    big = expect >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expect[big], expect[~big].sum())
    return ((obs - exp) ** 2 / exp).sum(), big.sum()

  p = np.asarray(jax.nn.softmax(logits / 0.8), np.float64)
  stat, dof = chi2(p)
  bound = stats.chi2.ppf(1 - 1e-6, dof)
  assert stat < bound, (stat, bound)
  wrong, _ = chi2(np.asarray(jax.nn.softmax(logits), np.float64))
  assert wrong > 10 * bound, (wrong, bound)
  np.testing.assert_allclose(np.asarray(logprobs), np.log(p[tokens]), rtol=1e-5)


def test_inverse_cdf_tokens_hand_worked_cases():
  """probs [0, 1, 0, 0 | 2, 0, 0, 0 | 0] (V = 9: blocks of 4, the last padded): block masses
  [1, 2, 0], cumulative [1, 3, 3]. u = 0 picks the first entry with mass (index 1, not the
  zero-mass index 0 whose cumulative sum 0 is not above 0); u0 = 1/3 puts u0 * 3 = 1 on the first
  block's cumulative mass, so block 1 (index 4); u0 = 1 - 2**-24 gives 2.9999998, inside block 1,
  not the empty block 2 (whose cumulative sum 3 is also above it); u1 near 1 inside block 0
  stays on index 1, not the zero-mass entries after it. An all-zero row gives index 0."""
  from sao_jax.rollout.engine import inverse_cdf_tokens  # pylint: disable=import-outside-toplevel
  probs = jnp.asarray([0.0, 1.0, 0.0, 0.0, 2.0, 0.0, 0.0, 0.0, 0.0])
  near_one = 1.0 - 2.0 ** -24
  u = jnp.asarray([[0.0, 0.0], [0.2, near_one], [1 / 3, 0.0], [near_one, near_one],
                   [0.5, 0.5]], jnp.float32)
  got = jax.vmap(lambda x: inverse_cdf_tokens(probs, x))(u)
  np.testing.assert_array_equal(np.asarray(got), [1, 1, 4, 4, 4])
  assert int(inverse_cdf_tokens(jnp.zeros(9), jnp.asarray([0.5, 0.5]))) == 0


def _assert_greedy_equals_full_forward(model, prompt, seq, lps):
  """``seq`` = prompt + greedily decoded tokens: each decoded token is the argmax of a full
  forward pass over ``seq`` and its recorded log-prob (``lps``) that pass's, within 1e-5."""
  tokens = jnp.asarray(seq)[None]
  logits, _ = model(tokens, default_positions(tokens))
  logp = np.asarray(jax.nn.log_softmax(logits[0, len(prompt) - 1:-1]))
  want = np.argmax(logp, -1)
  np.testing.assert_array_equal(np.asarray(seq[len(prompt):]), want)
  np.testing.assert_allclose(lps, logp[np.arange(len(want)), want], atol=1e-5)


@pytest.mark.slow
def test_greedy_slots_across_live_length_buckets_equal_full_forward():
  """Slots at different lengths decode greedily through several live-length buckets
  (kv_bucket=8: 8, 16, then the whole cache); every slot's tokens and log-probs equal those of
  a full forward pass over its sequence (argmax, log_softmax within 1e-5)."""
  model = Transformer(CFG, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model)
  params = nnx.to_pure_dict(params)
  engine = SAOEngine(CFG, graphdef, Tok(), max_concurrent_decodes=3, max_prefill_length=16,
                     temperature=0.0, seed=0, kv_bucket=8)
  assert engine.cache_len == CFG.max_seq_len + 1 and engine.live_buckets() == [8, 16, 32, 65]
  prompts = [[1, 11, 12], [1] + list(range(13, 25)), [1, 30, 31, 32, 33, 34]]
  state = engine.init_decode_state()
  seqs, lps = [], []
  for i, p in enumerate(prompts):
    padded, n = engine.pad_to_bucket(p)
    prefix = engine.prefill(params=params, padded_tokens=padded, true_length=n)
    assert prefix.host_length == n
    state = engine.insert(prefix, state, i)
    seqs.append(list(p) + [int(prefix.token)])
    lps.append([float(prefix.logprob)])
  for _ in range(30):  # the longest slot reaches 13 + 30 = 43 > 32 positions
    state, res = engine.generate(params, state)
    for i in range(3):
      seqs[i].append(int(res.data[i, 0]))
      lps[i].append(float(res.logprobs[i, 0]))
  assert state.host_lengths == tuple(np.asarray(state.lengths).tolist())
  for i, p in enumerate(prompts):
    _assert_greedy_equals_full_forward(model, p, seqs[i], lps[i])


@pytest.mark.slow
def test_prefill_chunk_past_the_cache_end_drops_the_padding():
  """A padded observation chunk that runs past ``cache_len`` (= max_seq_len + 1): the padding
  beyond the end is dropped, the true tokens are cached, and the next token's log-prob equals a
  full forward pass."""
  model, _, params, engine = _setup(temperature=0.0)
  first = list(range(10, 26)) * 3 + [10] * 8  # 56 tokens, in 4 chunks of <= 16
  prefix = None
  for s in range(0, len(first), 16):
    padded, n = engine.pad_to_bucket(first[s:s + 16])
    prefix = engine.prefill(params=params, existing_prefix=prefix, padded_tokens=padded,
                            true_length=n)
  obs = [11, 12, 13, 14, 15]  # written at 56..60, padded to 8: 56..63 < 65; then past the end
  padded, n = engine.pad_to_bucket(obs)
  prefix = engine.prefill(params=params, existing_prefix=prefix, padded_tokens=padded,
                          true_length=n)
  more = [16, 17]  # positions 61, 62; the padding to 8 would reach 68 > 64
  padded, n = engine.pad_to_bucket(more)
  prefix = engine.prefill(params=params, existing_prefix=prefix, padded_tokens=padded,
                          true_length=n)
  assert prefix.host_length == 63 == int(prefix.length)
  tokens = jnp.asarray(first + obs + more)[None]
  logits, _ = model(tokens, default_positions(tokens))
  logp = np.asarray(jax.nn.log_softmax(logits[0, -1]))
  assert int(prefix.token) == int(np.argmax(logp))
  np.testing.assert_allclose(float(prefix.logprob), logp.max(), atol=1e-5)


@pytest.mark.slow
def test_batched_prefill_and_multi_step_decode_equal_the_one_at_a_time_path():
  """``prefill_insert`` (3 prompts of different lengths in one call, slots 2, 0, 3) followed by
  ``generate_steps`` (7 + 7 steps, crossing live-length buckets) gives, greedily, the tokens and
  log-probs of a full forward pass (argmax, log_softmax within 1e-5); sampling at temperature 1,
  ``generate_steps(n)`` draws the same tokens as n calls of ``generate`` from the same state."""
  model = Transformer(CFG, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model)
  params = nnx.to_pure_dict(params)
  engine = SAOEngine(CFG, graphdef, Tok(), max_concurrent_decodes=4, max_prefill_length=16,
                     temperature=0.0, seed=0, kv_bucket=8)
  prompts = {2: [1, 11, 12], 0: [1] + list(range(13, 25)), 3: [1, 30, 31, 32, 33, 34]}
  state, first, first_lp = engine.prefill_insert(params, engine.init_decode_state(),
                                                 list(prompts), list(prompts.values()))
  assert state.host_lengths == (13, 0, 3, 6)
  seqs = {s: list(p) + [int(t)] for (s, p), t in zip(prompts.items(), first)}
  lps = {s: [float(l)] for s, l in zip(prompts, first_lp)}
  for _ in range(2):
    state, toks, lp = engine.generate_steps(params, state, 7)
    assert toks.shape == (4, 7) and lp.shape == (4, 7)
    for s in prompts:
      seqs[s] += toks[s].tolist()
      lps[s] += lp[s].tolist()
  assert state.host_lengths == tuple(np.asarray(state.lengths).tolist())
  for s, p in prompts.items():
    _assert_greedy_equals_full_forward(model, p, seqs[s], lps[s])
  # sampled: one scan of 5 steps == 5 generate calls from a copy of the same state
  sampler = SAOEngine(CFG, graphdef, Tok(), max_concurrent_decodes=4, max_prefill_length=16,
                      temperature=1.0, seed=0, kv_bucket=8)
  copy = jax.tree.map(lambda x: x.copy(), state)
  _, toks, lp = sampler.generate_steps(params, state, 5)
  one = []
  for _ in range(5):
    copy, res = sampler.generate(params, copy)
    one.append((np.asarray(res.data[:, 0]), np.asarray(res.logprobs[:, 0])))
  np.testing.assert_array_equal(toks, np.stack([t for t, _ in one], 1))
  np.testing.assert_allclose(lp, np.stack([l for _, l in one], 1), atol=1e-5)


def test_prefill_rows_all_pads_to_every_slot_and_draws_what_pow2_draws():
  """``prefill_rows="all"`` (``rollout.prefill_rows``): one prompt into slot 3 of 4 runs as 4
  rows (pow2: 1 row) and samples the same token and log-prob into the same cache; any other
  value is refused naming the field."""
  _, graphdef, params, pow2 = _setup(temperature=1.0)
  every = SAOEngine(CFG, graphdef, Tok(), max_concurrent_decodes=4, max_prefill_length=16,
                    temperature=1.0, seed=0, prefill_rows="all")
  rows = []
  for e in (pow2, every):  # the token rows each engine's compiled prefill is called with
    jitted = e._prefill_insert_jit
    e._prefill_insert_jit = lambda *a, jitted=jitted, **k: rows.append(a[3].shape[0]) or \
        jitted(*a, **k)
  out = [e.prefill_insert(params, e.init_decode_state(), [3], [[1, 11, 12, 13]])
         for e in (pow2, every)]
  assert rows == [1, 4]
  (a, ta, la), (b, tb, lb) = out
  assert ta.tolist() == tb.tolist() and la.tolist() == lb.tolist()
  assert a.host_lengths == b.host_lengths == (0, 0, 0, 4)
  np.testing.assert_array_equal(np.asarray(jax.tree.leaves(a.cache)[0]),
                                np.asarray(jax.tree.leaves(b.cache)[0]))
  with pytest.raises(ValueError, match="rollout.prefill_rows"):
    SAOEngine(CFG, graphdef, Tok(), prefill_rows="some")


@pytest.mark.slow
def test_prefill_insert_appends_an_observation_in_place_equal_to_a_full_forward():
  """Greedy: two slots decode 6 tokens each in one ``generate_steps`` call; slot 1's turn
  "ended" after its 3rd token, so an observation chunk [ended token, 6, 7, 8, 9] is appended at
  its true length with ``prefill_insert(starts=)`` (the decode state ran 3 positions past it,
  which the chunk overwrites), then both decode 5 more. Both sequences equal a full forward
  pass (argmax, log-probs within 1e-5; observation tokens are not scored); slot 0's cache is
  bitwise untouched by the append, and slot 1's before its start too (the write is in place)."""
  model, graphdef, params, _ = _setup(temperature=0.0, slots=2)
  engine = SAOEngine(CFG, graphdef, Tok(), max_concurrent_decodes=2, max_prefill_length=16,
                     temperature=0.0, seed=0, kv_bucket=8)
  prompts = [[1, 11, 12, 13], [1, 20, 21]]
  state, first, first_lp = engine.prefill_insert(params, engine.init_decode_state(), [0, 1],
                                                 prompts)
  state, toks, lp = engine.generate_steps(params, state, 6)
  seq0, lp0 = prompts[0] + [int(first[0])] + toks[0].tolist(), [float(first_lp[0])] + lp[0].tolist()
  kept = [int(first[1])] + toks[1, :2].tolist()  # slot 1's turn: 3 tokens, the last ends it
  seq1, lp1 = prompts[1] + kept, [float(first_lp[1])] + lp[1, :2].tolist()
  before = jax.tree.map(np.asarray, state.cache)
  start = len(seq1) - 1  # the ending token is sampled, not cached
  state, tok, tlp = engine.prefill_insert(params, state, [1], [[seq1[-1], 6, 7, 8, 9]], rows=1,
                                          starts=[start])
  assert state.host_lengths == (len(seq0) - 1, start + 5)
  for (k0, v0), (k1, v1) in zip(before, state.cache):
    np.testing.assert_array_equal(np.asarray(k1)[0], k0[0])
    np.testing.assert_array_equal(np.asarray(v1)[0], v0[0])
    np.testing.assert_array_equal(np.asarray(k1)[1, ..., :start], k0[1, ..., :start])
  seq1 += [6, 7, 8, 9, int(tok[0])]
  obs_lps = [float(tlp[0])]
  state, toks, lp = engine.generate_steps(params, state, 5)
  seq0 += toks[0].tolist()
  lp0 += lp[0].tolist()
  seq1 += toks[1].tolist()
  obs_lps += lp[1].tolist()
  _assert_greedy_equals_full_forward(model, prompts[0], seq0, lp0)
  n = len(prompts[1]) + len(kept)
  _assert_greedy_equals_full_forward(model, prompts[1], seq1[:n], lp1)
  _assert_greedy_equals_full_forward(model, seq1[:n + 4], seq1, obs_lps)


@pytest.mark.slow
def test_multi_step_decode_rollout_logprobs_equal_recomputed_inline_and_pooled():
  """``RolloutWorker(decode_steps=4)``: turns end part-way through an engine call (stop tokens,
  ``max_new_tokens``), the rest of the call is discarded, observations are prefilled at the
  slot's true length -- inline and with the env on a thread pool. Every
  trajectory's log-probs still equal a full forward pass over it (1e-5), and tokens were
  discarded (so the part-way path ran)."""
  model, _, params, engine = _setup(temperature=0.7)
  problems = [P(str(i), [10 + i, 11, 12 + i]) for i in range(6)]
  for env_workers in (0, 2):
    out = []
    worker = RolloutWorker(engine, EchoEnv(), iter(problems), lambda t: out.append(t) or True,
                           WeightStore(params), stop_ids=Tok.stop_ids, max_new_tokens=6,
                           max_seq_len=CFG.max_seq_len, seed=1, decode_steps=4,
                           env_workers=env_workers)
    worker.run()
    assert len(out) == 6 and worker.stats.tokens_discarded > 0
    for traj in out:
      mask = traj.action_mask > 0
      np.testing.assert_allclose(traj.logprobs[mask], _recompute(model, traj, 0.7)[mask],
                                 atol=1e-5)
    assert any(((t.action_mask[:-1] == 0) & (np.arange(len(t.tokens) - 1) > 3)).any()
               for t in out)


def test_prefill_insert_and_generate_steps_refuse_bad_input_naming_the_fix():
  _, _, params, engine = _setup(temperature=0.0)
  state = engine.init_decode_state()
  with pytest.raises(ValueError, match="2 slots for 1 prompts"):
    engine.prefill_insert(params, state, [0, 1], [[1, 2]])
  with pytest.raises(ValueError, match="max_prefill_length=16"):
    engine.prefill_insert(params, state, [0], [list(range(1, 20))])
  with pytest.raises(ValueError, match="rows=1 < 2"):
    engine.prefill_insert(params, state, [0, 1], [[1, 2], [1, 3]], rows=1)
  with pytest.raises(ValueError, match=r"slots \[1, 1\] must be distinct and in 0..3"):
    engine.prefill_insert(params, state, [1, 1], [[1, 2], [1, 3]])
  for bad in (4, -1):
    with pytest.raises(ValueError, match=r"rollout.slots=4"):
      engine.prefill_insert(params, state, [bad], [[1, 2]])
  with pytest.raises(ValueError, match="1 starts for 2 slots"):
    engine.prefill_insert(params, state, [0, 1], [[1, 2], [1, 3]], starts=[0])
  with pytest.raises(ValueError, match="starts=3 for slot 0, whose cache holds 0 positions"):
    engine.prefill_insert(params, state, [0], [[1, 2]], starts=[3])
  with pytest.raises(ValueError, match=f"model.max_seq_len={CFG.max_seq_len}"):
    engine.prefill_insert(params, state, [0], [[1, 2]], starts=[CFG.max_seq_len - 2])
  with pytest.raises(ValueError, match="rollout.decode_steps"):
    engine.generate_steps(params, state, 0)
  with pytest.raises(ValueError, match="rollout.decode_steps=0 must be >= 1"):
    RolloutWorker(engine, EchoEnv(), iter([]), lambda t: True, WeightStore(params),
                  stop_ids=Tok.stop_ids, max_new_tokens=4, max_seq_len=CFG.max_seq_len,
                  decode_steps=0)


def test_prefill_insert_row_padding_and_reseed_do_not_change_the_draws():
  """9 fresh prompts into a 32-slot state: padded to 16 rows (the default) and to 32 rows, each
  after ``reseed(7)``, give the same tokens, and log-probs and cache rows within 1e-5, for those
  slots, and the 23 other slots' caches stay bitwise as they were (padding rows write nothing). At
  temperature 10, so the toy model's draws depend on the key: a different seed draws other
  tokens."""
  _, graphdef, params, _ = _setup()
  engine = SAOEngine(CFG, graphdef, Tok(), max_concurrent_decodes=32, max_prefill_length=16,
                     temperature=10.0, seed=0)
  rng = np.random.default_rng(0)
  base, _, _ = engine.prefill_insert(params, engine.init_decode_state(), range(32),
                                     [list(rng.integers(3, CFG.vocab_size, 6)) for _ in range(32)])
  slots = [1, 0, 5, 9, 12, 17, 20, 26, 30]  # not 31, where a clipped padding row would write
  prompts = [list(rng.integers(3, CFG.vocab_size, int(n))) for n in rng.integers(2, 12, 9)]
  out = {}
  for rows, seed in ((None, 7), (32, 7), (None, 8)):
    engine.reseed(seed)
    state, toks, lps = engine.prefill_insert(params, jax.tree.map(lambda x: x.copy(), base),
                                             slots, prompts, rows=rows)
    out[rows, seed] = (toks, lps, [np.asarray(c) for kv in state.cache for c in kv])
  (t16, l16, c16), (t32, l32, c32) = out[None, 7], out[32, 7]
  np.testing.assert_array_equal(t16, t32)
  # bitwise here; a tolerance because the matmuls differ in shape (16 vs 32 rows), so another
  # CPU's kernels may round a row differently (appended chunks do here: <= 7e-7)
  np.testing.assert_allclose(l16, l32, rtol=1e-5, atol=1e-5)
  others = [s for s in range(32) if s not in slots]
  for a, b, old in zip(c16, c32, [np.asarray(c) for kv in base.cache for c in kv]):
    np.testing.assert_allclose(a[slots], b[slots], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(a[others], old[others])  # untouched: bitwise
  assert not np.array_equal(out[None, 8][0], t16)
