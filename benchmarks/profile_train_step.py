"""Where the tiny DIS policy step's time goes: a breakdown by parts, each jitted and timed
interleaved (forward loss; forward + backward; + entropy; full step with the optimizer).

    python benchmarks/profile_train_step.py [--config tiny] [--repeats 7]
"""

from __future__ import annotations

import common  # pylint: disable=import-error
import jax
import jax.numpy as jnp
import optax
from flax import nnx

import bench_train_step as bts  # pylint: disable=import-error
from sao_jax import algo
from sao_jax.models.transformer import Transformer, default_positions
from sao_jax.train import optim, steps
from sao_jax.train.batch import Batch


def main():
  ap = common.parser(__doc__, malloc_flag=True)
  ap.add_argument("--config", default="tiny")
  args = ap.parse_args()
  common.apply_malloc(args)
  cfg = bts.CONFIGS[args.config]
  b, t = (2, 32) if args.quick else (8, 256)
  graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
  params = nnx.to_pure_dict(params)
  batch = {k: jnp.asarray(v) for k, v in bts.make_batch(cfg, b, t).items()
           if k in ("tokens", "action_mask", "rollout_logprobs", "advantages")}

  def loss(p, with_entropy):
    model = nnx.merge(graphdef, p)
    logits, _ = model(batch["tokens"], default_positions(batch["tokens"]))
    if with_entropy:
      logp, ent = steps.token_logprobs_and_entropy(logits, batch["tokens"])
    else:
      logp, ent = steps.token_logprobs(logits, batch["tokens"]), None
    return algo.get_objective("dis")(logp, batch["rollout_logprobs"], batch["advantages"],
                                     batch["action_mask"], entropy=ent, eps_low=0.3,
                                     eps_high=5.0)[0]

  fwd = jax.jit(lambda p: loss(p, True))
  grad_noent = jax.jit(jax.grad(lambda p: loss(p, False)))
  grad = jax.jit(jax.grad(lambda p: loss(p, True)))
  tx = optim.make_optimizer(params, lr=1e-5, max_grad_norm=1.0)
  plain_tx = optax.adamw(1e-5)
  opt_state, plain_state = tx.init(params), plain_tx.init(params)
  upd = jax.jit(lambda g, s, p: tx.update(g, s, p))
  plain_upd = jax.jit(lambda g, s, p: plain_tx.update(g, s, p))
  learner, full, _ = common.learner_steps(graphdef, params, None, None, 1e-5, mode="grpo_sync",
                                          objective="dis")  # policy only (no critic)
  st = {"s": learner.policy}
  full_batch = Batch.of(batch["tokens"], batch["action_mask"],
                        rollout_logprobs=batch["rollout_logprobs"])
  g = grad(params)

  def full_step():
    st["s"], m = full(st["s"], full_batch, batch["advantages"], None)
    return m["policy_loss"]

  times = common.time_interleaved({
      "forward (loss)": lambda: fwd(params),
      "fwd+bwd, no entropy": lambda: grad_noent(params),
      "fwd+bwd (with entropy)": lambda: grad(params),
      "optimizer update (clip+adamw+apply_if_finite)": lambda: upd(g, opt_state, params),
      "plain adamw update": lambda: plain_upd(g, plain_state, params),
      "full policy step": full_step}, warmup=2, repeats=1 if args.quick else args.repeats)
  full_t = common.median(times["full policy step"])
  rows = [{"part": k, "median_ms": common.median(v) * 1e3,
           "fraction of full step": common.median(v) / full_t} for k, v in times.items()]
  common.report(f"profile_train_step ({args.config}, {b}x{t})", rows, args)


if __name__ == "__main__":
  main()
