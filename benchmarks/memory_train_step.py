"""Compiled memory and FLOPs of one policy step and one critic step, without running them.

``python benchmarks/memory_train_step.py [--preset smollm2-135m] [--layers 4] [--rows 16]
[--length 96] [--logprob-chunk 512]``: builds abstract params (``nnx.eval_shape``), lowers
``steps.policy_update`` (DIS, the learner's defaults) and ``steps.critic_update`` (attention
frozen) with ``jax.ShapeDtypeStruct`` arguments, compiles them for this machine's backend and
prints ``memory_analysis()`` (argument / output / temp bytes) and ``cost_analysis()`` FLOPs.
Runs on any checkout of the steps (options the code does not have are left out), so the same
command measures the code before and after a change. ``--logprob-chunk 0`` is the full
``[B, T, V]`` log-prob path; ``--no-freeze-split`` differentiates the frozen critic leaves too.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json

import jax
import jax.numpy as jnp
from flax import nnx

from sao_jax.models import presets
from sao_jax.models.transformer import Critic, Transformer
from sao_jax.train import optim, steps
from sao_jax.train.batch import Batch


def abstract_batch(rows: int, length: int) -> Batch:
  s = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt)
  bt, b = (rows, length), (rows,)
  return Batch(tokens=s(bt, jnp.int32), action_mask=s(bt, jnp.bool_),
               rollout_logprobs=s(bt, jnp.float32), policy_version=s(bt, jnp.int32),
               reward=s(b, jnp.float32), last_action=s(b, jnp.int32), last_index=s(b, jnp.int32),
               truncated=s(b, jnp.bool_), group_id=s(b, jnp.int32), baseline=s(b, jnp.float32))


def report(compiled) -> dict:
  m = compiled.memory_analysis()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return {"argument_bytes": int(m.argument_size_in_bytes),
          "output_bytes": int(m.output_size_in_bytes), "temp_bytes": int(m.temp_size_in_bytes),
          "flops": float(cost.get("flops", 0.0))}


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--preset", default="smollm2-135m")
  ap.add_argument("--layers", type=int, default=4)
  ap.add_argument("--rows", type=int, default=16)
  ap.add_argument("--length", type=int, default=96)
  ap.add_argument("--logprob-chunk", type=int, default=512)
  ap.add_argument("--no-freeze-split", action="store_true")
  ap.add_argument("--skip", default="", help="'policy' or 'critic' to measure only the other")
  a = ap.parse_args(argv)
  cfg = presets.get_preset(a.preset, n_layers=a.layers, dtype="float32", param_dtype="float32")
  out = {"preset": a.preset, "layers": a.layers, "rows": a.rows, "length": a.length,
         "vocab": cfg.vocab_size}
  batch = abstract_batch(a.rows, a.length)
  tok = jax.ShapeDtypeStruct((a.rows, a.length), jnp.float32)

  if a.skip != "policy":
    pg, pstate = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    params = nnx.to_pure_dict(pstate)
    tx = optim.make_optimizer(params, lr=1e-6)
    state = jax.eval_shape(lambda p: steps.TrainState.create(p, tx), params)
    kw = dict(objective="dis", objective_kwargs=dict(eps_low=0.3, eps_high=5.0),
              temperature=1.0)
    if "logprob_chunk" in inspect.signature(steps.policy_update).parameters:
      kw["logprob_chunk"] = a.logprob_chunk
      out["logprob_chunk"] = a.logprob_chunk
    fn = jax.jit(functools.partial(steps.policy_update, pg, tx, **kw), donate_argnums=0)
    out["policy"] = report(fn.lower(state, batch, tok, None).compile())

  if a.skip != "critic":
    cg, cstate = nnx.split(nnx.eval_shape(lambda: Critic(cfg, rngs=nnx.Rngs(0))))
    cparams = nnx.to_pure_dict(cstate)
    patterns = (r"/attn/",)
    ctx = optim.make_optimizer(cparams, lr=1e-6, frozen_patterns=patterns)
    cst = jax.eval_shape(lambda p: steps.TrainState.create(p, ctx), cparams)
    ckw = {}
    if "frozen_patterns" in inspect.signature(steps.critic_update).parameters:
      ckw["frozen_patterns"] = () if a.no_freeze_split else patterns
      out["freeze_split"] = not a.no_freeze_split
    fn = jax.jit(functools.partial(steps.critic_update, cg, ctx, **ckw), donate_argnums=0)
    out["critic"] = report(fn.lower(cst, batch, {"returns": tok, "values": tok}).compile())
  print(json.dumps(out))
  return out


if __name__ == "__main__":
  main()
