"""Tests for sao_jax.algo: hand-worked cases, rlax oracle, properties, robustness."""

import repo_paths  # tests/repo_paths.py
import json
import pathlib

from absl.testing import parameterized
import chex
import hypothesis
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import rlax

from sao_jax import algo

import advantage_oracles  # GRPO and running-mean formulas (tests/advantage_oracles.py)
import dis_reference  # the first DIS loss, a test oracle (tests/dis_reference.py)

_CASES_PATH = pathlib.Path(repo_paths.TESTS) / 'data' / 'sao_cases.json'
CASES = json.loads(_CASES_PATH.read_text())

# (name, numpy dtype, rtol, atol). x64 is enabled only inside `_precision`.
_DTYPES = (
    ('float64', np.float64, 1e-6, 1e-12),
    ('float32', np.float32, 1e-4, 1e-6),
)


def _precision(dtype):
  """Context that turns x64 on for float64 tests only (never globally)."""
  return jax.enable_x64(dtype == np.float64)


def _arr(x, dtype):
  return np.asarray(x, dtype=dtype)


# ----------------------------------------------------------------------------
# 1. Hand-worked cases (tests/data/sao_cases.json), float64 and float32.
# ----------------------------------------------------------------------------


class DisCasesTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.named_parameters(*_DTYPES)
  def test_math_band(self, dtype, rtol, atol):
    case = CASES['dis_token_mean_math_band']
    inp, exp = case['inputs'], case['expected']
    with _precision(dtype):
      lp = _arr(inp['logprobs'], dtype)
      rlp = _arr(inp['rollout_logprobs'], dtype)
      adv = _arr(inp['advantages'], dtype)
      mask = _arr(inp['action_mask'], dtype)
      eps_low, eps_high = inp['eps_low'], inp['eps_high']

      loss_fn = self.variant(dis_reference.dis_policy_loss)
      loss, metrics = loss_fn(lp, rlp, adv, mask, eps_low, eps_high)
      self.assertEqual(loss.dtype, dtype)
      np.testing.assert_allclose(loss, exp['loss'], rtol=rtol, atol=atol)
      np.testing.assert_allclose(
          metrics['masked_fraction'], exp['masked_fraction'], rtol=rtol)
      for v in metrics.values():
        self.assertEqual(v.dtype, dtype)

      grad_fn = self.variant(jax.grad(
          lambda x, r, a, m, lo, hi: dis_reference.dis_policy_loss(x, r, a, m, lo, hi)[0]
      ))
      grad = grad_fn(lp, rlp, adv, mask, eps_low, eps_high)
      np.testing.assert_allclose(
          grad, np.asarray(exp['grad_wrt_logprobs']), rtol=rtol, atol=atol)

      ratio = np.exp(lp - rlp).astype(dtype)
      kept = self.variant(dis_reference.dis_keep_mask)(ratio, mask, eps_low, eps_high)
      np.testing.assert_array_equal(kept, np.asarray(exp['kept'], bool))

      # Metrics against a direct NumPy computation.
      np.testing.assert_allclose(metrics['ratio_mean'], ratio.mean(), rtol=rtol)
      np.testing.assert_allclose(metrics['ratio_max'], ratio.max(), rtol=rtol)
      np.testing.assert_allclose(
          metrics['masked_fraction_low'], np.mean(ratio <= 1 - eps_low),
          rtol=rtol)
      np.testing.assert_allclose(
          metrics['masked_fraction_high'], np.mean(ratio >= 1 + eps_high),
          rtol=rtol)
      np.testing.assert_allclose(
          metrics['abs_logp_diff_mean'], np.abs(lp - rlp).mean(), rtol=rtol)
      np.testing.assert_allclose(
          metrics['approx_kl_k3'], np.mean(ratio - 1 - np.log(ratio)),
          rtol=rtol)
    # x64 must not leak out of the context.
    self.assertEqual(jnp.asarray(1.0).dtype, jnp.float32)

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.named_parameters(('math', 'math'), ('coding', 'coding'))
  def test_band_boundaries_float64(self, band):
    case = CASES['dis_band_boundaries']
    inp = case['inputs'][band]
    expected = np.asarray(case['expected'][f'{band}_kept'], bool)
    with _precision(np.float64):
      ratio = _arr(inp['ratios'], np.float64)[None]
      mask = np.ones_like(ratio)
      kept = self.variant(dis_reference.dis_keep_mask)(
          ratio, mask, inp['eps_low'], inp['eps_high'])
      np.testing.assert_array_equal(kept[0], expected)

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.named_parameters(('math', 0.3, 5.0), ('coding', 0.8, 3.0))
  def test_band_boundaries_float32(self, eps_low, eps_high):
    with _precision(np.float32):
      f32 = np.float32
      low = f32(1.0) - f32(eps_low)
      high = f32(1.0) + f32(eps_high)
      ratio = np.array([[low, np.nextafter(low, f32(np.inf)),
                         np.nextafter(high, f32(-np.inf)), high, 1.0]], f32)
      mask = np.array([[1, 1, 1, 1, 1]], np.int32)
      kept = self.variant(dis_reference.dis_keep_mask)(ratio, mask, eps_low, eps_high)
      np.testing.assert_array_equal(kept[0], [False, True, True, False, True])
      # Non-action tokens are never kept, even at ratio 1.
      kept = self.variant(dis_reference.dis_keep_mask)(
          ratio, np.zeros_like(mask), eps_low, eps_high)
      self.assertFalse(np.any(kept))


class GaeCasesTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.named_parameters(*_DTYPES)
  def test_skip_observation_one_row(self, dtype, rtol, atol):
    case = CASES['skip_observation_gae_one_row']
    inp = case['inputs']
    with _precision(dtype):
      r = _arr(inp['rewards'], dtype)
      v = _arr(inp['values'], dtype)
      m = _arr(inp['action_mask'], dtype)
      gae = self.variant(algo.skip_observation_gae)
      for exp in case['expected'].values():
        adv, ret = gae(r, v, m, exp['gamma'], exp['lam'])
        self.assertEqual(adv.dtype, dtype)
        self.assertEqual(ret.dtype, dtype)
        np.testing.assert_allclose(adv, exp['advantages'], rtol=rtol, atol=atol)
        np.testing.assert_allclose(ret, exp['returns'], rtol=rtol, atol=atol)
        # Values (and rewards) at observation positions never matter.
        obs = m == 0
        v2 = np.where(obs, np.nan, v).astype(dtype)
        r2 = np.where(obs, -123.0, r).astype(dtype)
        adv2, ret2 = gae(r2, v2, m, exp['gamma'], exp['lam'])
        np.testing.assert_array_equal(adv2, adv)
        np.testing.assert_array_equal(ret2, ret)

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.named_parameters(*_DTYPES)
  def test_length_adaptive_lambda(self, dtype, rtol, atol):
    case = CASES['length_adaptive_lambda']
    with _precision(dtype):
      counts = np.asarray(case['inputs']['action_token_counts'])
      lam = self.variant(algo.length_adaptive_lambda)(
          counts, case['inputs']['alpha'])
      self.assertEqual(lam.dtype, dtype)
      np.testing.assert_allclose(
          lam, case['expected']['lam'], rtol=rtol, atol=atol)
      # l = 0 gives 0, no division by zero; float counts keep their dtype.
      lam0 = self.variant(algo.length_adaptive_lambda)(
          np.array([0.0, 1.0], dtype), 1.5)
      self.assertEqual(lam0.dtype, dtype)
      np.testing.assert_allclose(lam0, [0.0, 1.0 / 3.0], rtol=rtol)

  def test_length_adaptive_lambda_bad_alpha(self):
    with self.assertRaises(ValueError):
      algo.length_adaptive_lambda(np.array([3]), alpha=0.0)

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.named_parameters(*_DTYPES)
  def test_running_mean_baseline(self, dtype, rtol, atol):
    case = CASES['running_mean_baseline']
    with _precision(dtype):
      fn = self.variant(advantage_oracles.running_mean_baseline_advantage)
      adv = fn(_arr(case['inputs']['new_reward'], dtype),
               _arr(case['inputs']['window'], dtype))
      self.assertEqual(adv.dtype, dtype)
      np.testing.assert_allclose(
          adv, case['expected']['advantage'], rtol=rtol, atol=atol)
      # Empty window: baseline 0.
      adv = fn(_arr(0.7, dtype), np.zeros((0,), dtype))
      np.testing.assert_allclose(adv, 0.7, rtol=rtol)
      # Batched windows.
      adv = fn(_arr([1.0, 0.0], dtype), _arr([[1, 0, 0, 1], [1, 1, 1, 0]], dtype))
      np.testing.assert_allclose(adv, [0.5, -0.75], rtol=rtol)


class ValueCasesTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.named_parameters(*_DTYPES)
  def test_value_loss_and_explained_variance(self, dtype, rtol, atol):
    case = CASES['value_loss_and_explained_variance']
    inp, exp = case['inputs'], case['expected']
    with _precision(dtype):
      v = _arr(inp['values'], dtype)
      r = _arr(inp['returns'], dtype)
      m = _arr(inp['action_mask'], dtype)
      old = _arr(inp['old_values'], dtype)
      loss, metrics = self.variant(algo.value_loss)(v, r, m)
      self.assertEqual(loss.dtype, dtype)
      np.testing.assert_allclose(
          loss, exp['value_loss_mse_token_mean'], rtol=rtol, atol=atol)
      np.testing.assert_allclose(metrics['value_loss'], loss, rtol=rtol)
      sel = m.astype(bool)
      np.testing.assert_allclose(metrics['value_mean'], v[sel].mean(), rtol=rtol)
      np.testing.assert_allclose(
          metrics['return_mean'], r[sel].mean(), rtol=rtol)
      ev = self.variant(algo.explained_variance)(old, r, m)
      self.assertEqual(ev.dtype, dtype)
      np.testing.assert_allclose(
          ev, exp['explained_variance_of_old_values'], rtol=rtol, atol=atol)

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.named_parameters(*_DTYPES)
  def test_value_clipping(self, dtype, rtol, atol):
    with _precision(dtype):
      v = _arr([[0.0, 1.0, 2.0, 5.0]], dtype)
      old = _arr([[0.5, 0.5, 0.5, 0.5]], dtype)
      r = _arr([[1.0, 1.0, 0.0, 9.0]], dtype)
      m = _arr([[1, 1, 1, 0]], dtype)
      loss, metrics = self.variant(algo.value_loss)(
          v, r, m, old_values=old, clip_eps=0.2)
      v_clip = old + np.clip(v - old, -0.2, 0.2)
      per_tok = np.maximum((v - r) ** 2, (v_clip - r) ** 2)
      np.testing.assert_allclose(loss, per_tok[0, :3].mean(), rtol=rtol)
      clipped = ((v_clip - r) ** 2 > (v - r) ** 2)[0, :3]
      np.testing.assert_allclose(
          metrics['value_clipped_fraction'], clipped.mean(), rtol=rtol)

  def test_value_clipping_needs_old_values(self):
    with self.assertRaises(ValueError):
      algo.value_loss(jnp.zeros((1, 2)), jnp.zeros((1, 2)), jnp.ones((1, 2)),
                      clip_eps=0.2)

  def test_value_loss_gradient(self):
    v = jnp.array([[0.3, 0.35, 7.0]])
    r = jnp.array([[1.0, 0.0, 1.0]])
    m = jnp.array([[1, 1, 0]])
    g_v, g_r = jax.grad(lambda a, b: algo.value_loss(a, b, m)[0], (0, 1))(v, r)
    np.testing.assert_allclose(g_v, [[2 * (0.3 - 1) / 2, 2 * 0.35 / 2, 0.0]],
                               rtol=1e-6)
    np.testing.assert_array_equal(g_r, np.zeros_like(r))  # targets detached

  def test_explained_variance_degenerate(self):
    m = jnp.array([[1, 1, 0]])
    # Constant returns -> Var(R) = 0 -> 0.0, not NaN.
    ev = algo.explained_variance(jnp.array([[0.1, 0.2, 0.3]]),
                                 jnp.array([[1.0, 1.0, 5.0]]), m)
    self.assertEqual(float(ev), 0.0)
    # Returns constant up to float noise (all rewards 0, returns = tiny critic values): 0.0, not
    # -1e14 (seen in a collapsed run before this guard).
    ev = algo.explained_variance(jnp.array([[0.01, -0.02, 0.0]]),
                                 jnp.array([[1e-7, 1.1e-7, 0.0]]), m)
    self.assertEqual(float(ev), 0.0)
    # No action tokens.
    ev = algo.explained_variance(jnp.ones((2, 3)), jnp.ones((2, 3)),
                                 jnp.zeros((2, 3)))
    self.assertEqual(float(ev), 0.0)
    # Perfect critic -> 1; NaN values at padding don't leak.
    ev = algo.explained_variance(jnp.array([[1.0, 2.0, jnp.nan]]),
                                 jnp.array([[1.0, 2.0, 3.0]]), m)
    np.testing.assert_allclose(ev, 1.0)


# ----------------------------------------------------------------------------
# 2. Oracle: all-action trajectories equal rlax truncated GAE.
# ----------------------------------------------------------------------------


def _rlax_gae(rewards, values, gamma, lam, bootstrap):
  values_ext = jnp.concatenate([values, bootstrap[:, None]], axis=1)
  discount = jnp.full(rewards.shape, gamma, rewards.dtype)
  return jax.vmap(rlax.truncated_generalized_advantage_estimation,
                  in_axes=(0, 0, None, 0))(rewards, discount, lam, values_ext)


class RlaxOracleTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.named_parameters(
      ('terminal', False, 1.0, 1.0),
      ('terminal_discounted', False, 0.97, 0.9),
      ('bootstrap', True, 0.99, 0.95),
      ('bootstrap_lam0', True, 0.9, 0.0),
  )
  def test_matches_rlax(self, use_bootstrap, gamma, lam):
    rng = np.random.default_rng(0)
    b, t = 5, 23
    rewards = rng.normal(size=(b, t)).astype(np.float32)
    values = rng.normal(size=(b, t)).astype(np.float32)
    mask = np.ones((b, t), np.float32)
    bootstrap = (rng.normal(size=(b,)).astype(np.float32) if use_bootstrap
                 else np.zeros((b,), np.float32))
    expected = _rlax_gae(rewards, values, gamma, lam, bootstrap)
    kwargs = {'bootstrap_value': bootstrap} if use_bootstrap else {}
    adv, ret = self.variant(algo.skip_observation_gae)(
        rewards, values, mask, gamma, lam, **kwargs)
    np.testing.assert_allclose(adv, expected, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(ret, expected + values, rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------
# 3. Property: inserting observation tokens never changes action advantages.
# ----------------------------------------------------------------------------

_T_MAX = 48  # fixed padded length, so the jitted function compiles once.
_gae_jit = jax.jit(algo.skip_observation_gae)
_finite = st.floats(-10.0, 10.0, width=32)
_anything = st.floats(width=32, allow_nan=True, allow_infinity=True)


@st.composite
def _interleaved(draw):
  n = draw(st.integers(1, 10))
  rewards = draw(st.lists(_finite, min_size=n, max_size=n))
  values = draw(st.lists(_finite, min_size=n, max_size=n))
  gaps = draw(st.lists(st.integers(0, 3), min_size=n + 1, max_size=n + 1))
  n_obs = sum(gaps)
  obs_r = draw(st.lists(_anything, min_size=n_obs, max_size=n_obs))
  obs_v = draw(st.lists(_anything, min_size=n_obs, max_size=n_obs))
  gamma = draw(st.floats(0.0, 1.0, width=32))
  lam = draw(st.floats(0.0, 1.0, width=32))
  return rewards, values, gaps, obs_r, obs_v, gamma, lam


@hypothesis.settings(max_examples=40, deadline=None, database=None)
@hypothesis.given(_interleaved())
def test_observation_tokens_are_skipped(example):
  rewards, values, gaps, obs_r, obs_v, gamma, lam = example
  n = len(rewards)
  # Compact all-action trajectory, padded to _T_MAX.
  r0 = np.zeros((1, _T_MAX), np.float32)
  v0 = np.zeros((1, _T_MAX), np.float32)
  m0 = np.zeros((1, _T_MAX), np.float32)
  r0[0, :n], v0[0, :n], m0[0, :n] = rewards, values, 1.0
  # Same actions with observation tokens inserted before / between / after.
  r1, v1, m1 = np.zeros_like(r0), np.full_like(v0, 7.0), np.zeros_like(m0)
  pos, k, action_pos = 0, 0, []
  for i in range(n + 1):
    for _ in range(gaps[i]):
      r1[0, pos], v1[0, pos] = obs_r[k], obs_v[k]
      pos, k = pos + 1, k + 1
    if i < n:
      r1[0, pos], v1[0, pos], m1[0, pos] = rewards[i], values[i], 1.0
      action_pos.append(pos)
      pos += 1
  adv0, ret0 = _gae_jit(r0, v0, m0, np.float32(gamma), np.float32(lam))
  adv1, ret1 = _gae_jit(r1, v1, m1, np.float32(gamma), np.float32(lam))
  adv1, ret1 = np.asarray(adv1), np.asarray(ret1)
  np.testing.assert_allclose(adv1[0, action_pos], adv0[0, :n], rtol=1e-6,
                             atol=1e-6)
  np.testing.assert_allclose(ret1[0, action_pos], ret0[0, :n], rtol=1e-6,
                             atol=1e-6)
  off = m1[0] == 0
  np.testing.assert_array_equal(adv1[0, off], 0.0)
  np.testing.assert_array_equal(ret1[0, off], 0.0)


# ----------------------------------------------------------------------------
# 4. Robustness.
# ----------------------------------------------------------------------------


def _all_finite(tree):
  return all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(tree))


class RobustnessTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_huge_log_ratio_is_finite(self):
    rng = np.random.default_rng(1)
    rlp = rng.normal(size=(2, 6)).astype(np.float32) - 3.0
    lp = rlp + np.array([[1e4, -1e4, 1e4, -1e4, 0.0, 0.1],
                         [-1e4, 1e4, 0.0, 0.0, 1e4, -1e4]], np.float32)
    adv = rng.normal(size=(2, 6)).astype(np.float32)
    mask = np.ones((2, 6), np.float32)

    def f(x):
      return dis_reference.dis_policy_loss(x, rlp, adv, mask, 0.3, 5.0)

    (loss, metrics), grad = self.variant(
        jax.value_and_grad(f, has_aux=True))(lp)
    self.assertTrue(_all_finite((loss, metrics, grad)))
    np.testing.assert_allclose(metrics['masked_fraction'], 8 / 12, rtol=1e-6)
    np.testing.assert_allclose(metrics['masked_fraction_low'], 4 / 12,
                               rtol=1e-6)
    np.testing.assert_allclose(metrics['masked_fraction_high'], 4 / 12,
                               rtol=1e-6)
    np.testing.assert_allclose(metrics['abs_logp_diff_mean'],
                               np.abs(lp - rlp).mean(), rtol=1e-4)
    # Only the four in-band tokens have a gradient.
    self.assertEqual(int(np.sum(np.asarray(grad) != 0)),
                     int(np.sum(np.abs(lp - rlp) < 1.0)))

  @chex.variants(with_jit=True, without_jit=True)
  def test_garbage_at_padding_does_not_leak(self):
    lp = np.array([[-1.0, -0.5, np.nan, -np.inf]], np.float32)
    rlp = np.array([[-1.1, -0.4, np.inf, np.nan]], np.float32)
    adv = np.array([[1.0, -2.0, np.nan, np.inf]], np.float32)
    mask = np.array([[1, 1, 0, 0]], np.int32)

    def f(x):
      return dis_reference.dis_policy_loss(x, rlp, adv, mask, 0.3, 5.0)

    (loss, metrics), grad = self.variant(
        jax.value_and_grad(f, has_aux=True))(lp)
    self.assertTrue(_all_finite((loss, metrics, grad)))
    r = np.exp(lp[0, :2] - rlp[0, :2])
    np.testing.assert_allclose(loss, -(r * adv[0, :2]).sum() / 2, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(grad)[0, 2:], 0.0)

  @chex.variants(with_jit=True, without_jit=True)
  def test_row_without_action_tokens(self):
    rng = np.random.default_rng(2)
    lp = (rng.normal(size=(2, 5)) * 0.1 - 1.0).astype(np.float32)
    rlp = (lp + rng.normal(size=(2, 5)) * 0.1).astype(np.float32)
    adv = rng.normal(size=(2, 5)).astype(np.float32)
    mask = np.array([[1, 1, 0, 1, 0], [0, 0, 0, 0, 0]], np.float32)

    def f(x, r, a, m):
      return dis_reference.dis_policy_loss(x, r, a, m, 0.3, 5.0)

    vg = self.variant(jax.value_and_grad(f, has_aux=True))
    (loss, metrics), grad = vg(lp, rlp, adv, mask)
    (loss0, _), grad0 = vg(lp[:1], rlp[:1], adv[:1], mask[:1])
    self.assertTrue(_all_finite((loss, metrics, grad)))
    np.testing.assert_allclose(loss, loss0, rtol=1e-6)
    np.testing.assert_allclose(grad[:1], grad0, rtol=1e-6)
    np.testing.assert_array_equal(grad[1], 0.0)
    # GAE: the empty row is all zeros.
    adv_out, ret_out = self.variant(algo.skip_observation_gae)(
        adv, lp, mask, 1.0, 0.9)
    np.testing.assert_array_equal(adv_out[1], 0.0)
    np.testing.assert_array_equal(ret_out[1], 0.0)

  @chex.variants(with_jit=True, without_jit=True)
  def test_all_padding_batch(self):
    z = np.zeros((3, 4), np.float32)
    loss, metrics = self.variant(dis_reference.dis_policy_loss)(
        z - 1.0, z - 2.0, z + 1.0, z, 0.3, 5.0)
    self.assertEqual(float(loss), 0.0)
    self.assertTrue(_all_finite(metrics))
    for v in metrics.values():
      self.assertEqual(float(v), 0.0)
    vloss, vmetrics = self.variant(algo.value_loss)(z + 1.0, z, z)
    self.assertEqual(float(vloss), 0.0)
    self.assertTrue(_all_finite(vmetrics))
    ev = self.variant(algo.explained_variance)(z + 1.0, z, z)
    self.assertEqual(float(ev), 0.0)

  @chex.variants(with_jit=True, without_jit=True)
  def test_bf16_inputs_give_float32(self):
    rng = np.random.default_rng(3)
    lp = jnp.asarray(rng.normal(size=(2, 7)) * 0.2 - 1.0, jnp.bfloat16)
    rlp = jnp.asarray(rng.normal(size=(2, 7)) * 0.2 - 1.0, jnp.bfloat16)
    adv = jnp.asarray(rng.normal(size=(2, 7)), jnp.bfloat16)
    mask = np.array([[1] * 7, [1, 1, 1, 0, 0, 0, 0]], np.float32)
    loss, metrics = self.variant(dis_reference.dis_policy_loss)(
        lp, rlp, adv, mask, 0.3, 5.0)
    self.assertEqual(loss.dtype, jnp.float32)
    for v in metrics.values():
      self.assertEqual(v.dtype, jnp.float32)
    ref, _ = dis_reference.dis_policy_loss(lp.astype(jnp.float32),
                                  rlp.astype(jnp.float32),
                                  adv.astype(jnp.float32), mask, 0.3, 5.0)
    np.testing.assert_allclose(loss, ref, rtol=1e-6)
    grad = jax.grad(lambda x: dis_reference.dis_policy_loss(
        x, rlp, adv, mask, 0.3, 5.0)[0])(lp)
    self.assertEqual(grad.dtype, jnp.bfloat16)
    self.assertTrue(_all_finite(grad))

  def test_rank_guards(self):
    with self.assertRaises(AssertionError):
      dis_reference.dis_policy_loss(jnp.zeros(3), jnp.zeros(3), jnp.zeros(3),
                           jnp.ones(3), 0.3, 5.0)
    with self.assertRaises(AssertionError):
      algo.skip_observation_gae(jnp.zeros((2, 3)), jnp.zeros((2, 3)),
                                jnp.ones((2, 3)), 1.0, jnp.ones(3))
    with self.assertRaises(AssertionError):
      algo.skip_observation_gae(jnp.zeros((2, 3)), jnp.zeros((2, 4)),
                                jnp.ones((2, 3)), 1.0, 0.9)


# ----------------------------------------------------------------------------
# 5. Per-row lambda equals running each row with its own scalar lambda.
# ----------------------------------------------------------------------------


class PerRowLambdaTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_per_row_lambda(self):
    rng = np.random.default_rng(4)
    b, t = 4, 19
    rewards = rng.normal(size=(b, t)).astype(np.float32)
    values = rng.normal(size=(b, t)).astype(np.float32)
    mask = (rng.uniform(size=(b, t)) < 0.6).astype(np.float32)
    mask[3] = 0.0  # one empty row
    bootstrap = rng.normal(size=(b,)).astype(np.float32)
    lam = algo.length_adaptive_lambda(mask.sum(axis=1).astype(np.int32))
    gae = self.variant(algo.skip_observation_gae)
    adv, ret = gae(rewards, values, mask, 0.99, lam, bootstrap_value=bootstrap)
    for i in range(b):
      sl = slice(i, i + 1)
      adv_i, ret_i = gae(rewards[sl], values[sl], mask[sl], 0.99, lam[i],
                         bootstrap_value=bootstrap[sl])
      np.testing.assert_allclose(adv[sl], adv_i, rtol=1e-6, atol=1e-7)
      np.testing.assert_allclose(ret[sl], ret_i, rtol=1e-6, atol=1e-7)
