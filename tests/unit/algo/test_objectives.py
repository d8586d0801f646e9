"""Policy objectives and advantage estimators of the algorithm family: hand-worked numbers, slow
NumPy references, hypothesis properties, float64 finite-difference gradients, robustness."""

import functools

import hypothesis
from hypothesis import strategies as st
import jax
from jax import test_util as jtu
import jax.numpy as jnp
import numpy as np
import pytest

from sao_jax import algo

import advantage_oracles  # GRPO and running-mean formulas (tests/advantage_oracles.py)
import dis_reference  # the first DIS loss, a test oracle (tests/dis_reference.py)

OBJ = algo.OBJECTIVES
_PPO_FAMILY = ("ppo_clip", "tis", "icepop")


def _call(name, lp, rlp, adv, mask, **kw):
  return OBJ[name](lp, rlp, adv, mask, **kw)


# ---- 1. hand-worked numbers --------------------------------------------------------------------

# One row, old = 0 so r = exp(lp) = [0.5, 1, 1.5, 2]; A = [1, -1, 1, -1]; band (0.8, 1.28).
R = np.array([[0.5, 1.0, 1.5, 2.0]])
A = np.array([[1.0, -1.0, 1.0, -1.0]])
M = np.ones((1, 4))


def test_ppo_clip_hand_worked():
  """l_t = -min(r A, clip(r, 0.8, 1.28) A):
    t0 r=.5 A=1:  min(.5, .8)=.5 -> -.5   (unclipped branch, grad -A r = -.5)
    t1 r=1 A=-1:  -> 1                    (grad -A r = 1)
    t2 r=1.5 A=1: min(1.5, 1.28) -> -1.28 (clipped high: grad 0)
    t3 r=2 A=-1:  min(-2, -1.28)=-2 -> 2  (unclipped: grad -A r = 2)
  token mean: (-.5 + 1 - 1.28 + 2) / 4 = .305; grad / 4 = [-.125, .25, 0, .5].
  Dual clip c=1.5 caps t3 at -c A = 1.5 (grad 0): (-.5 + 1 - 1.28 + 1.5)/4 = .18."""
  with jax.enable_x64(True):
    lp, z = np.log(R), np.zeros_like(R)
    f = lambda x, **kw: OBJ["ppo_clip"](x, z, A, M, old_logprobs=z, **kw)
    (loss, m), g = jax.value_and_grad(f, has_aux=True)(lp)
    np.testing.assert_allclose(loss, 0.305, rtol=1e-12)
    np.testing.assert_allclose(g, [[-0.125, 0.25, 0.0, 0.5]], rtol=1e-12)
    assert m["masked_fraction"] == 0.25 and m["masked_fraction_high"] == 0.25
    assert m["masked_fraction_pos_adv"] == 0.25 and m["masked_fraction_neg_adv"] == 0.0
    np.testing.assert_allclose([m["ratio_min"], m["ratio_max"], m["ratio_mean"]], [0.5, 2, 1.25])
    (loss, m), g = jax.value_and_grad(lambda x: f(x, dual_clip=1.5), has_aux=True)(lp)
    np.testing.assert_allclose(loss, 0.18, rtol=1e-12)
    np.testing.assert_allclose(g, [[-0.125, 0.25, 0.0, 0.0]], rtol=1e-12)
    assert m["masked_fraction"] == 0.5 and m["masked_fraction_neg_adv"] == 0.25
    # ESS of the gradient weights [.5, 1, 0, 0]: (1.5)^2 / (4 * 1.25) = .45.
    np.testing.assert_allclose(m["ess_fraction"], 0.45, rtol=1e-12)
    with pytest.raises(ValueError, match="dual_clip"):
      f(lp, dual_clip=0.5)


def test_tis_and_icepop_hand_worked():
  """rho = pi_old / pi_rollout = [1, 3, .4, 1] (rollout = -log rho, old = 0).
  TIS, cap 2: w = [1, 2, .4, 1]; loss = (-.5*1 + 1*2 - 1.28*.4 + 2*1) / 4 = 2.988 / 4 = .747.
  IcePop [.5, 5]: t2 masked (.4 < .5): loss = (-.5 + 1 + 0 + 2) / 4 = .625."""
  with jax.enable_x64(True):
    lp, z = np.log(R), np.zeros_like(R)
    rlp = -np.log([[1.0, 3.0, 0.4, 1.0]])
    loss, m = OBJ["tis"](lp, rlp, A, M, old_logprobs=z, tis_cap=2.0)
    np.testing.assert_allclose(loss, 0.747, rtol=1e-12)
    np.testing.assert_allclose(m["tis_weight_mean"], 4.4 / 4, rtol=1e-12)
    np.testing.assert_allclose(m["mismatch_abs_logp"], (np.log(3) + np.log(2.5)) / 4, rtol=1e-12)
    np.testing.assert_allclose(m["mismatch_exp_abs_minus_1"], (2 + 1.5) / 4, rtol=1e-12)
    np.testing.assert_allclose(m["mismatch_kl_k3"],
                               (2 - np.log(3) + (0.4 - 1 - np.log(0.4))) / 4, rtol=1e-12)
    loss, m = OBJ["icepop"](lp, rlp, A, M, old_logprobs=z, icepop_low=0.5, icepop_high=5.0)
    np.testing.assert_allclose(loss, 0.625, rtol=1e-12)
    assert m["icepop_masked_fraction"] == 0.25 and m["masked_fraction_low"] == 0.25
    with pytest.raises(ValueError, match="icepop"):
      OBJ["icepop"](lp, rlp, A, M, icepop_low=1.2)


def test_reinforce_and_dis_hand_worked():
  """REINFORCE: lp = [-1, -2, -.5, -3], A = [1, -1, 2, 0]: l = -A lp = [1, -2, 1, 0], mean 0,
  grad -A/4 = [-.25, .25, -.5, 0]. DIS equals the walking skeleton's dis_policy_loss."""
  lp = np.array([[-1.0, -2.0, -0.5, -3.0]], np.float32)
  adv = np.array([[1.0, -1.0, 2.0, 0.0]], np.float32)
  (loss, _), g = jax.value_and_grad(OBJ["reinforce"], has_aux=True)(lp, lp, adv, M)
  np.testing.assert_allclose(loss, 0.0, atol=1e-7)
  np.testing.assert_allclose(g, [[-0.25, 0.25, -0.5, 0.0]], rtol=1e-6)
  rng = np.random.default_rng(0)
  lp = rng.normal(size=(3, 7)).astype(np.float32) - 1
  rlp = lp + 0.6 * rng.normal(size=(3, 7)).astype(np.float32)
  adv = rng.normal(size=(3, 7)).astype(np.float32)
  mask = (rng.uniform(size=(3, 7)) < 0.7).astype(np.float32)
  ref = dis_reference.dis_policy_loss(lp, rlp, adv, mask, 0.3, 5.0)
  new = OBJ["dis"](lp, rlp, adv, mask, eps_low=0.3, eps_high=5.0)
  np.testing.assert_array_equal(new[0], ref[0])
  for k, v in ref[1].items():
    np.testing.assert_array_equal(new[1][k], v, err_msg=k)
  g_ref = jax.grad(lambda x: dis_reference.dis_policy_loss(x, rlp, adv, mask, 0.3, 5.0)[0])(lp)
  g_new = jax.grad(lambda x: OBJ["dis"](x, rlp, adv, mask)[0])(lp)
  np.testing.assert_array_equal(g_new, g_ref)


def test_aggregations_kl_and_entropy_hand_worked():
  """per-token [[1, 2, x], [3, x, x], [x, x, x]] (x = padding, even NaN):
  token_mean 6/3 = 2; seq_mean (1.5 + 3)/2 = 2.25 (empty row not counted); sum_norm C=4: 1.5."""
  x = np.array([[1.0, 2.0, np.nan], [3.0, np.inf, 0.0], [np.nan, 5.0, 5.0]])
  m = np.array([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
  assert float(algo.aggregate(x, m)) == 2.0
  assert float(algo.aggregate(x, m, "seq_mean")) == 2.25
  assert float(algo.aggregate(x, m, "sum_norm", 4.0)) == 1.5
  with pytest.raises(ValueError, match="norm_constant"):
    algo.aggregate(x, m, "sum_norm")
  with pytest.raises(ValueError, match="train.aggregation"):
    algo.aggregate(x, m, "max")
  # KL to reference: k3 with ref - lp = log 2 on every token: 2 - 1 - log 2 = .30685.
  # Entropy bonus: loss - 0.1 * mean(entropy) = loss - 0.1 * 1.5.
  lp = np.full((1, 4), -1.0, np.float32)
  adv = np.zeros((1, 4), np.float32)
  ent = np.array([[1.0, 2.0, 1.0, 2.0]], np.float32)
  for name in OBJ:
    base, _ = _call(name, lp, lp, adv, M)
    loss, met = _call(name, lp, lp, adv, M, ref_logprobs=lp + np.log(2.0), kl_coef=0.5,
                      entropy=ent, entropy_coef=0.1)
    np.testing.assert_allclose(loss - base, 0.5 * (1 - np.log(2.0)) - 0.15, rtol=1e-5)
    np.testing.assert_allclose(met["kl_ref"], 1 - np.log(2.0), rtol=1e-5)
    np.testing.assert_allclose(met["entropy"], 1.5, rtol=1e-6)
    with pytest.raises(ValueError, match="ref_logprobs"):
      _call(name, lp, lp, adv, M, kl_coef=0.1)


def test_estimators_hand_worked():
  """GRPO [1,0,0,1]: mean .5, std .5 -> [1,-1,-1,1] (no std: +-.5); constant group -> 0.
  Step GAE, gamma = lam = 1, turns {0,1}, {3,4,5}, reward 1 on token 5, V = [.1,.2,_,.4,.5,.6]:
    last: V1=.2, V2=.6: A2 = 1 - .6 = .4, A1 = 0 + .6 - .2 + .4 = .8
    mean: V1=.15, V2=.5: A2 = .5, A1 = .5 - .15 + .5 = .85; returns all 1.
  Naive GAE, mask [0,1,0,1,1,0], V = [.1,.2,.3,.4,.5,.6], reward 1 on token 4:
    t4: 1 - .5 = .5; t3: .5 - .4 + .5 = .6; t2 (obs): .4 - .3 + .6 = .7; t1: .3 - .2 + .7 = .8
    (skip-observation would give t1: .4 - .2 + .6 = .8 too at lam=1 -- so use lam=.5:
     naive t3 = -.4+.5+.5*.5... see the numbers below, derived by the same recursion).
  Bootstrap: one action, r=0, V=.3, bootstrap .5: A = .5 - .3 = .2, R = .5."""
  np.testing.assert_allclose(
      advantage_oracles.grpo_advantages(np.array([[1, 0, 0, 1], [1, 1, 1, 1]])),
      [[1, -1, -1, 1], [0, 0, 0, 0]], atol=1e-5)
  np.testing.assert_allclose(advantage_oracles.grpo_advantages(np.array([[1.0, 0, 0, 1]]), False),
                             [[0.5, -0.5, -0.5, 0.5]])
  r = np.array([[0, 0, 0, 0, 0, 1.0]])
  v = np.array([[0.1, 0.2, 9.0, 0.4, 0.5, 0.6]])
  m = np.array([[1, 1, 0, 1, 1, 1]])
  adv, ret = algo.step_level_gae(r, v, m, 1.0, 1.0, "last")
  np.testing.assert_allclose(adv, [[0.8, 0.8, 0, 0.4, 0.4, 0.4]], rtol=1e-6)
  np.testing.assert_allclose(ret, [[1, 1, 0, 1, 1, 1]], rtol=1e-6)
  adv, _ = algo.step_level_gae(r, v, m, 1.0, 1.0, "mean")
  np.testing.assert_allclose(adv, [[0.85, 0.85, 0, 0.5, 0.5, 0.5]], rtol=1e-6)
  with pytest.raises(ValueError, match="value_reduction"):
    algo.step_level_gae(r, v, m, 1.0, 1.0, "max")
  # Naive vs skip-observation with lam = .5, gamma = 1, reward 1 on token 4.
  r = np.array([[0, 0, 0, 0, 1.0, 0]])
  v = np.array([[0.1, 0.2, 0.3, 0.4, 0.5, 0.6]])
  m = np.array([[0, 1, 0, 1, 1, 0]])
  # naive: d4 = .5, A4 = .5; d3 = .1, A3 = .1 + .25 = .35; d2 = .1, A2 = .1 + .175 = .275;
  #        d1 = .1, A1 = .1 + .1375 = .2375.  skip: A1 = (.4 - .2) + .5 * .35 = .375.
  adv, _ = algo.naive_token_gae(r, v, m, 1.0, 0.5)
  np.testing.assert_allclose(adv, [[0, 0.2375, 0, 0.35, 0.5, 0]], rtol=1e-6)
  adv, _ = algo.skip_observation_gae(r, v, m, 1.0, 0.5)
  np.testing.assert_allclose(adv, [[0, 0.375, 0, 0.35, 0.5, 0]], rtol=1e-6)
  # Decoupled lambda: critic returns (lam 1, gamma 1) are the Monte-Carlo return 1 everywhere.
  _, ret = algo.skip_observation_gae(r, v, m, 1.0, 1.0)
  np.testing.assert_allclose(ret, [[0, 1, 0, 1, 1, 0]], rtol=1e-6)
  adv, ret = algo.skip_observation_gae(np.zeros((1, 1)), np.array([[0.3]]), np.ones((1, 1)),
                                       1.0, 0.9, bootstrap_value=np.array([0.5]))
  np.testing.assert_allclose([adv[0, 0], ret[0, 0]], [0.2, 0.5], rtol=1e-6)
  np.testing.assert_allclose(
      algo.broadcast_to_tokens(np.array([2.0, -1.0]), m[[0, 0]] * [[1], [0]]),
      [[0, 2, 0, 2, 2, 0], [0] * 6])


# ---- 2. slow NumPy reference + hypothesis properties -------------------------------------------


def _np_reference(name, lp, rlp, old, adv, mask, eps_low, eps_high, cap=2.0, ice=(0.5, 5.0)):
  """Plain per-token loops of every objective, token mean."""
  total, n = 0.0, 0
  for b in range(lp.shape[0]):
    for t in range(lp.shape[1]):
      if not mask[b, t]:
        continue
      n += 1
      a = adv[b, t]
      if name == "dis":
        r = np.exp(lp[b, t] - rlp[b, t])
        total += -r * a if 1 - eps_low < r < 1 + eps_high else 0.0
      elif name == "reinforce":
        total += -a * lp[b, t]
      else:
        r = np.exp(lp[b, t] - old[b, t])
        l = -min(r * a, min(max(r, 1 - eps_low), 1 + eps_high) * a)
        rho = np.exp(old[b, t] - rlp[b, t])
        if name == "tis":
          l *= min(rho, cap)
        if name == "icepop" and not ice[0] <= rho <= ice[1]:
          l = 0.0
        total += l
  return total / max(n, 1)


@st.composite
def _batch(draw):
  b, t = draw(st.integers(1, 3)), draw(st.integers(1, 6))
  fl = lambda lo, hi: st.lists(st.floats(lo, hi), min_size=b * t, max_size=b * t)
  lp = -np.abs(np.array(draw(fl(0, 4)))).reshape(b, t)
  rlp = lp + np.array(draw(fl(-1, 1))).reshape(b, t)
  old = lp + np.array(draw(fl(-0.5, 0.5))).reshape(b, t)
  adv = np.array(draw(fl(-3, 3))).reshape(b, t)
  mask = np.array(draw(st.lists(st.booleans(), min_size=b * t, max_size=b * t))).reshape(b, t)
  return lp, rlp, old, adv, mask


_SETTINGS = hypothesis.settings(max_examples=15, deadline=None, database=None,
                                suppress_health_check=[hypothesis.HealthCheck.too_slow])


@pytest.mark.slow
@_SETTINGS
@hypothesis.given(_batch(), st.sampled_from(sorted(OBJ)))
def test_matches_numpy_reference_and_masking_invariance(batch, name):
  lp, rlp, old, adv, mask = batch
  eps = (0.3, 5.0) if name == "dis" else (0.2, 0.28)
  kw = {} if name == "reinforce" else dict(eps_low=eps[0], eps_high=eps[1])
  with jax.enable_x64(True):
    loss, _ = _call(name, lp, rlp, adv, mask, old_logprobs=old, **kw)
    np.testing.assert_allclose(loss, _np_reference(name, lp, rlp, old, adv, mask, *eps),
                               rtol=1e-9, atol=1e-12)
    # Anything at non-action positions (NaN, inf, huge) changes nothing.
    junk = lambda x: np.where(mask, x, np.nan)
    loss2, met2 = _call(name, junk(lp), np.where(mask, rlp, -np.inf), junk(adv), mask,
                        old_logprobs=np.where(mask, old, 1e4), **kw)
    np.testing.assert_array_equal(loss2, loss)
    assert all(np.isfinite(float(v)) for v in met2.values())


@pytest.mark.slow
@_SETTINGS
@hypothesis.given(_batch(), st.sampled_from(sorted(OBJ)))
def test_zero_advantage_gives_zero_gradient(batch, name):
  lp, rlp, old, _, mask = batch
  adv0 = np.zeros_like(lp)
  g = jax.grad(lambda x: _call(name, x, rlp, adv0, mask, old_logprobs=old)[0])(lp)
  np.testing.assert_array_equal(g, 0.0)


@pytest.mark.slow
@_SETTINGS
@hypothesis.given(_batch())
def test_dis_with_infinite_band_is_plain_is_and_ppo_equals_dis_inside_the_band(batch):
  lp, rlp, _, adv, mask = batch
  with jax.enable_x64(True):
    f_dis = lambda x: OBJ["dis"](x, rlp, adv, mask, eps_low=1 - 1e-12, eps_high=1e30)[0]
    r = np.exp(lp - rlp)
    np.testing.assert_allclose(f_dis(lp), -(r * adv)[mask].sum() / max(mask.sum(), 1),
                               rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(jax.grad(f_dis)(lp),
                               np.where(mask, -r * adv, 0) / max(mask.sum(), 1),
                               rtol=1e-9, atol=1e-12)
    # PPO clip with old = rollout and a band containing every ratio is DIS (same sign conventions).
    lo, hi = 1 - min(r.min(), 1) + 0.5, r.max() + 0.5
    lo = min(lo, 0.99)
    f_dis = lambda x: OBJ["dis"](x, rlp, adv, mask, eps_low=lo, eps_high=hi)
    f_ppo = lambda x: OBJ["ppo_clip"](x, rlp, adv, mask, old_logprobs=rlp, eps_low=lo, eps_high=hi)
    (l1, m1), g1 = jax.value_and_grad(f_dis, has_aux=True)(lp)
    (l2, m2), g2 = jax.value_and_grad(f_ppo, has_aux=True)(lp)
    np.testing.assert_allclose(l1, l2, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(g1, g2, rtol=1e-12, atol=1e-15)
    for k in ("masked_fraction", "ratio_mean", "ratio_max", "ess_fraction", "approx_kl_k3"):
      np.testing.assert_allclose(m1[k], m2[k], rtol=1e-12, err_msg=k)


@_SETTINGS
@hypothesis.given(st.integers(1, 8), st.integers(0, 4), st.floats(0, 1), st.floats(0, 1),
                  st.integers(0, 10**6))
@pytest.mark.slow
def test_estimator_properties(n, pad, gamma, lam, seed):
  rng = np.random.default_rng(seed)
  r = rng.normal(size=(2, n + pad))
  v = rng.normal(size=(2, n + pad))
  m = np.zeros((2, n + pad))
  m[:, pad:] = 1.0  # a prompt of `pad` tokens, then actions only: no observation in the span
  with jax.enable_x64(True):
    skip = algo.skip_observation_gae(r, v, m, gamma, lam)
    naive = algo.naive_token_gae(r, v, m, gamma, lam)
    np.testing.assert_allclose(naive, skip, rtol=1e-9, atol=1e-12)
    # Alternate action / observation tokens: every action is its own turn, so step-level GAE
    # (either value variant) is skip-observation GAE.
    m2 = np.zeros_like(m)
    m2[:, ::2] = 1.0
    skip = algo.skip_observation_gae(r, v, m2, gamma, lam)
    for red in ("mean", "last"):
      np.testing.assert_allclose(algo.step_level_gae(r, v, m2, gamma, lam, red), skip,
                                 rtol=1e-9, atol=1e-12)
    g = advantage_oracles.grpo_advantages(r)
    np.testing.assert_allclose(g.mean(-1), 0.0, atol=1e-9)
    np.testing.assert_allclose(g.std(-1), 1.0 if n + pad > 1 else 0.0, atol=1e-4)


# ---- 3. float64 gradients against finite differences --------------------------------------------


@pytest.mark.parametrize("name", sorted(OBJ))
@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean", "sum_norm"])
def test_gradient_matches_finite_differences(name, aggregation):
  """Ratios sit well inside / outside every band (|distance| >> the FD step), so the loss is
  smooth around the point; KL and entropy terms are on."""
  with jax.enable_x64(True):
    rng = np.random.default_rng(7)
    lp = -rng.uniform(0.2, 2.0, size=(3, 5))
    old = lp + rng.choice([-0.6, -0.05, 0.05, 0.6], size=lp.shape)
    rlp = old + rng.choice([-0.3, 0.1, 1.5], size=lp.shape)
    adv = rng.normal(size=lp.shape)
    mask = rng.uniform(size=lp.shape) < 0.8
    mask[2] = False
    ref = lp + 0.3
    ent = rng.uniform(0.5, 2.0, size=lp.shape)
    kw = dict(old_logprobs=old, aggregation=aggregation, norm_constant=7.0, ref_logprobs=ref,
              kl_coef=0.1, entropy=ent, entropy_coef=0.01)
    if name != "reinforce":
      kw.update(eps_low=0.3, eps_high=0.4)
    f = lambda x: _call(name, x, rlp, adv, mask, **kw)[0]
    jtu.check_grads(f, (lp,), order=1, modes=["rev"], eps=1e-6, atol=1e-7, rtol=1e-6)


# ---- 4. robustness -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(OBJ))
def test_robust_to_overflow_empty_rows_padding_and_bf16(name):
  leaves_finite = lambda tree: all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(tree))
  lp = np.array([[-1.0, -2.0, -0.5, -3.0], [-1.0, -1.0, -1.0, -1.0]], np.float32)
  adv = np.array([[1.0, -1.0, 2.0, -3.0], [1.0, 1.0, 1.0, 1.0]], np.float32)
  mask = np.array([[1, 1, 1, 1], [0, 0, 0, 0]], np.float32)  # second row: no action tokens
  vg = jax.value_and_grad(lambda x, r, o: _call(name, x, r, adv, mask, old_logprobs=o),
                          has_aux=True)
  for delta in (1e4, -1e4):
    out = vg(lp, lp - delta, lp + delta / 2)
    assert leaves_finite(out), (name, delta)
  (loss, _), g = vg(lp, lp, lp)
  (loss0, _), g0 = jax.value_and_grad(
      lambda x: _call(name, x, lp[:1], adv[:1], mask[:1], old_logprobs=lp[:1]),
      has_aux=True)(lp[:1])
  np.testing.assert_allclose(loss, loss0, rtol=1e-6)
  np.testing.assert_array_equal(g[1], 0.0)
  z = np.zeros((3, 4), np.float32)
  loss, met = _call(name, z - 1, z - 2, z + 1, z)
  assert float(loss) == 0.0 and all(float(v) == 0.0 for v in met.values())
  bf = lambda x: jnp.asarray(x, jnp.bfloat16)
  loss, met = _call(name, bf(lp), bf(lp + 0.1), bf(adv), mask, old_logprobs=bf(lp - 0.05),
                    entropy=bf(np.ones_like(lp)))
  assert loss.dtype == jnp.float32 and all(v.dtype == jnp.float32 for v in met.values())
  g = jax.grad(lambda x: _call(name, x, bf(lp), bf(adv), mask)[0])(bf(lp))
  assert g.dtype == jnp.bfloat16 and leaves_finite(g)


def test_estimator_robustness_and_guards():
  z = np.zeros((2, 5), np.float32)
  for fn in (functools.partial(algo.naive_token_gae, gamma=1.0, lam=0.9),
             functools.partial(algo.step_level_gae, gamma=1.0, lam=0.9),
             functools.partial(algo.skip_observation_gae, gamma=1.0, lam=0.9)):
    adv, ret = fn(z + 1, z + 1, z)  # all padding
    np.testing.assert_array_equal(adv, 0.0)
    np.testing.assert_array_equal(ret, 0.0)
    adv, _ = fn(jnp.asarray(z + 1, jnp.bfloat16), jnp.asarray(z, jnp.bfloat16), z + 1)
    assert adv.dtype == jnp.float32
  assert advantage_oracles.grpo_advantages(np.ones((2, 3), np.int32)).dtype == jnp.float32
  with pytest.raises(AssertionError):
    advantage_oracles.grpo_advantages(np.ones(3))
  with pytest.raises(ValueError, match="train.objective"):
    algo.get_objective("trpo")
