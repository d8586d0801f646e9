"""Skip-observation GAE: ``lax.scan`` (ours, default) vs an ``associative_scan`` formulation vs
rlax's GAE vs a NumPy loop, on [256, 8192] and [32, 131072] with 30% observation tokens.

    python benchmarks/bench_gae.py [--quick] [--json out.json]

Reports ns/token (median over interleaved repeats). rlax computes *standard* truncated GAE
(it cannot skip observation tokens), so it is a cost peer, not a value peer; the associative-scan
and NumPy variants are checked equal to ours before timing.
"""

from __future__ import annotations

import functools

import common  # pylint: disable=import-error
import jax
import jax.numpy as jnp
import numpy as np
import rlax

from sao_jax import algo


def skip_obs_gae_assoc(rewards, values, action_mask, gamma, lam, bootstrap_value=None):
  """Skip-observation GAE as two first-order linear recurrences solved by
  ``jax.lax.associative_scan`` (log-depth, Blelloch 1990), same contract as
  ``algo.skip_observation_gae`` for float32 [B, T] inputs and scalar or [B] ``lam``.

  Reverse recurrences x_t = a_t x_{t+1} + b_t, composed with (a1,b1)∘(a2,b2) = (a1 a2, a1 b2 + b1):
    V*_t = m_t ? V_t : V*_{t+1}                (a = 1 - m, b = m V; V*_{T} = bootstrap)
    A*_t = m_t ? delta_t + g l A*_{t+1} : A*_{t+1}   (a = m g l + 1 - m, b = m delta)
  with delta_t = r_t + g V*_{t+1} - V_t."""
  b_, _ = rewards.shape
  m = action_mask.astype(bool)
  mf = m.astype(rewards.dtype)
  lam = jnp.broadcast_to(jnp.asarray(lam, rewards.dtype), (b_,))[:, None]
  boot = (jnp.zeros((b_,), rewards.dtype) if bootstrap_value is None
          else bootstrap_value.astype(rewards.dtype))

  def combine(left, right):  # left is later in time (reverse scan)
    a1, b1 = left
    a2, b2 = right
    return a1 * a2, a2 * b1 + b2

  # V*_t over t, then V*_{t+1} (shifted; bootstrap past the end)
  a_v = 1.0 - mf
  b_v = mf * values
  # include the bootstrap as an extra column
  a_v = jnp.concatenate([a_v, jnp.zeros((b_, 1), rewards.dtype)], axis=1)
  b_v = jnp.concatenate([b_v, boot[:, None]], axis=1)
  _, vstar = jax.lax.associative_scan(combine, (a_v, b_v), reverse=True, axis=1)
  v_next = vstar[:, 1:]
  delta = rewards + gamma * v_next - values
  a_a = mf * (gamma * lam) + (1.0 - mf)
  b_a = mf * delta
  _, astar = jax.lax.associative_scan(combine, (a_a, b_a), reverse=True, axis=1)
  adv = jnp.where(m, astar, 0.0)
  ret = jnp.where(m, astar + values, 0.0)
  return adv, ret


def skip_obs_gae_numpy(rewards, values, action_mask, gamma, lam):
  """NumPy reference: the reverse loop over time, vectorised over the batch."""
  b_, t_ = rewards.shape
  adv = np.zeros_like(rewards)
  v_next = np.zeros(b_, rewards.dtype)
  a_next = np.zeros(b_, rewards.dtype)
  m = action_mask.astype(bool)
  for t in range(t_ - 1, -1, -1):
    mt = m[:, t]
    a = rewards[:, t] + gamma * v_next - values[:, t] + gamma * lam * a_next
    a_next = np.where(mt, a, a_next)
    v_next = np.where(mt, values[:, t], v_next)
    adv[:, t] = np.where(mt, a, 0.0)
  return adv, np.where(m, adv + values, 0.0)


def rlax_gae(rewards, values, gamma, lam):
  values_ext = jnp.concatenate([values, jnp.zeros_like(values[:, :1])], axis=1)
  discount = jnp.full(rewards.shape, gamma, rewards.dtype)
  return jax.vmap(rlax.truncated_generalized_advantage_estimation,
                  in_axes=(0, 0, None, 0))(rewards, discount, lam, values_ext)


def make_inputs(b, t, obs_frac=0.3, seed=0):
  """Rewards on the last action token of each row; observation tokens in runs of 8-32."""
  rng = np.random.default_rng(seed)
  mask = np.ones((b, t), np.float32)
  n_obs_target = int(obs_frac * t)
  for i in range(b):
    n = 0
    while n < n_obs_target:
      length = int(rng.integers(8, 33))
      start = int(rng.integers(0, t - length))
      n += int(mask[i, start:start + length].sum())
      mask[i, start:start + length] = 0.0
  values = rng.standard_normal((b, t)).astype(np.float32)
  rewards = np.zeros((b, t), np.float32)
  last = t - 1 - np.argmax(mask[:, ::-1] > 0, axis=1)
  rewards[np.arange(b), last] = rng.standard_normal(b).astype(np.float32)
  return rewards, values, mask


def main():
  ap = common.parser(__doc__)
  args = ap.parse_args()
  shapes = [(16, 512), (4, 2048)] if args.quick else [(256, 8192), (32, 131072)]
  repeats = 1 if args.quick else args.repeats
  gamma, lam = 1.0, 0.95
  ours = jax.jit(functools.partial(algo.skip_observation_gae, gamma=gamma, lam=lam))
  assoc = jax.jit(functools.partial(skip_obs_gae_assoc, gamma=gamma, lam=lam))
  peer = jax.jit(functools.partial(rlax_gae, gamma=gamma, lam=lam))
  rows = []
  for b, t in shapes:
    r, v, m = make_inputs(b, t)
    rj, vj, mj = map(jnp.asarray, (r, v, m))
    a0, r0 = ours(rj, vj, mj)
    a1, r1 = assoc(rj, vj, mj)
    np.testing.assert_allclose(np.asarray(a1), np.asarray(a0), rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(np.asarray(r1), np.asarray(r0), rtol=1e-4, atol=1e-3)
    if b * t <= 1 << 16:  # the NumPy loop is also checked on the small shapes
      a2, _ = skip_obs_gae_numpy(r, v, m, gamma, lam)
      np.testing.assert_allclose(a2, np.asarray(a0), rtol=1e-4, atol=1e-3)
    fns = {"lax.scan (ours)": lambda: ours(rj, vj, mj),
           "associative_scan": lambda: assoc(rj, vj, mj),
           "rlax (std GAE)": lambda: peer(rj, vj),
           "numpy loop": lambda: skip_obs_gae_numpy(r, v, m, gamma, lam)}
    times = common.time_interleaved(fns, warmup=1, repeats=repeats)
    base = common.median(times["lax.scan (ours)"])
    for name, ts in times.items():
      med = common.median(ts)
      rows.append({"shape": f"[{b}, {t}]", "impl": name, "median_ms": med * 1e3,
                   "ns/token": med / (b * t) * 1e9, "x vs ours": med / base})
  common.report("gae", rows, args)


if __name__ == "__main__":
  main()
