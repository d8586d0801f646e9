"""Rematerialisation (``model.remat``) and scan over layers (``model.scan_layers``): the same
logits, router logits and gradients as the plain unrolled forward; less backward memory with remat
under a scan; a scanned program whose size does not grow with depth; cached calls unaffected."""

import repo_paths  # tests/repo_paths.py
import dataclasses
import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sao_jax.models import transformer
from sao_jax.models.presets import get_preset
from sao_jax.models.transformer import (ModelConfig, Transformer, default_positions, init_cache,
                                        layer_runs, stack_states)
from sao_jax.train.validation import ConfigError, validate_config
from model_oracles import forward_with_aux

pytestmark = pytest.mark.slow  # every test here is slow (see pyproject's `slow` marker)

ROOT = repo_paths.ROOT
SETTINGS = [(remat, scan) for remat in ("none", "block", "dots_saveable")
            for scan in (False, True)]
MODELS = {
    "dense": get_preset("tiny-qwen3", n_layers=3),
    "moe": get_preset("tiny-qwen3-moe"),  # every layer MoE: one scan
    # dense layer 0, then MoE layers 1-2: a lone block and a scan of two
    "mixed": get_preset("tiny-qwen3-moe", n_layers=3, moe_layers=(1, 2)),
}


def _loss_fn(graphdef, tokens, mask):
  """Token log-likelihood of ``tokens`` (left-padded rows) plus the load-balancing loss, and the
  logits and router logits: ``state -> (loss, (logits, router_logits))``."""
  positions = default_positions(tokens)

  def loss(state):
    logits, aux = forward_with_aux(nnx.merge(graphdef, state), tokens, positions, mask)
    logp = jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1]), tokens[:, 1:, None], -1)[..., 0]
    ll = jnp.sum(logp * mask[:, 1:])
    return -ll + aux["load_balancing_loss"], (logits, aux["router_logits"])

  return loss


def _value_and_grad(cfg, state, tokens, mask):
  graphdef = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))[0]
  fn = jax.jit(jax.value_and_grad(_loss_fn(graphdef, tokens, mask), has_aux=True))
  return jax.device_get(fn(state))


@pytest.mark.parametrize("model", sorted(MODELS))
def test_remat_and_scan_give_equal_logits_and_gradients(model):
  """Every remat x scan setting against the plain unrolled forward (float32): loss, logits,
  router logits and every parameter's gradient. The mixed model runs the scan settings only
  (its unrolled remat is the dense and MoE models' code path)."""
  base = MODELS[model]
  _, state = nnx.split(Transformer(base, rngs=nnx.Rngs(0)))
  tokens = jax.random.randint(jax.random.key(1), (2, 24), 0, base.vocab_size)
  mask = jnp.ones((2, 24), jnp.int32).at[1, :5].set(0)  # row 1 left-padded: masked keys
  settings = [s for s in SETTINGS if model != "mixed" or s[1] or s[0] == "none"]
  results = {(remat, scan): _value_and_grad(dataclasses.replace(base, remat=remat,
                                                                 scan_layers=scan),
                                            state, tokens, mask)
             for remat, scan in settings}
  (ref_loss, (ref_logits, ref_router)), ref_grads = results[("none", False)]
  assert (ref_router is None) == (model == "dense")
  if ref_router is not None:
    assert ref_router.shape[0] == len(base.moe_layers)
  for key, ((loss, (logits, router)), grads) in results.items():
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6, err_msg=str(key))
    np.testing.assert_allclose(logits, ref_logits, atol=1e-5, rtol=1e-5, err_msg=str(key))
    if ref_router is not None:
      np.testing.assert_allclose(router, ref_router, atol=1e-5, rtol=1e-5, err_msg=str(key))
    flat, ref_flat = jax.tree.leaves_with_path(grads), jax.tree.leaves(ref_grads)
    assert len(flat) == len(ref_flat)
    for (path, g), r in zip(flat, ref_flat):
      assert float(jnp.max(jnp.abs(r))) > 0, path  # every parameter gets a gradient
      np.testing.assert_allclose(g, r, atol=1e-5, rtol=1e-5, err_msg=f"{key} {path}")


def test_scan_stacks_linear_kernels_in_the_compute_dtype(monkeypatch):
  """float32 parameters, bfloat16 compute: the stacked copy holds the nnx.Linear kernels in
  bfloat16 (norm scales and the float32 router as stored), and casting them before the stack
  changes nothing (bitwise equal loss, logits and gradients of a dense model)."""
  cfg = get_preset("tiny-qwen3-moe", param_dtype="float32", dtype="bfloat16", scan_layers=True,
                   remat="block")
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  _, stacked = stack_states(list(model.layers))
  stacked = nnx.to_pure_dict(stacked)
  assert stacked["attn"]["q_proj"]["kernel"].dtype == jnp.bfloat16
  assert stacked["attn"]["q_proj"]["kernel"].shape == (2, 64, 64)
  assert stacked["attn_norm"]["scale"].dtype == jnp.float32
  assert stacked["mlp"]["router"]["kernel"].dtype == jnp.float32
  cfg = get_preset("tiny-qwen3", param_dtype="float32", dtype="bfloat16", scan_layers=True)
  state = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))[1]
  tokens = jax.random.randint(jax.random.key(1), (2, 24), 0, cfg.vocab_size)
  mask = jnp.ones((2, 24), jnp.int32)
  cast = _value_and_grad(cfg, state, tokens, mask)
  monkeypatch.setattr(transformer, "_cast_for_compute", lambda block, state: state)
  as_stored = _value_and_grad(cfg, state, tokens, mask)
  for a, b in zip(jax.tree.leaves(cast), jax.tree.leaves(as_stored)):
    np.testing.assert_array_equal(a, b)


def test_layer_runs_split_dense_and_moe_stretches():
  def runs(cfg):
    return layer_runs(list(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))).layers))
  assert runs(MODELS["dense"]) == [(0, 3)]
  assert runs(MODELS["moe"]) == [(0, 2)]
  assert runs(MODELS["mixed"]) == [(0, 1), (1, 3)]
  assert runs(get_preset("tiny-qwen3-moe", n_layers=4, moe_layers=(0, 2))) == [
      (0, 1), (1, 2), (2, 3), (3, 4)]


def _compiled_backward(cfg, batch, seq):
  """``value_and_grad`` of a token log-likelihood, compiled for abstract float32 params."""
  graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
  tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)

  def loss(state, tokens):
    logits, _ = nnx.merge(graphdef, state)(tokens, default_positions(tokens))
    return jnp.sum(jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1]), tokens[:, 1:, None],
                                       -1))

  return jax.jit(jax.value_and_grad(loss)).lower(state, tokens)


def test_remat_lowers_backward_temp_bytes():
  """XLA:CPU temp bytes of a 4-layer model's backward at 2 x 512 tokens: remat inside the scan
  keeps one block's activations instead of every layer's. (Unrolled, XLA:CPU merges the
  recomputation back into the forward and saves little, unlike the TPU compiler: not asserted;
  see ``benchmarks/RESULTS.md`` section 5.)"""
  base = get_preset("tiny-qwen3", n_layers=4, max_seq_len=512)
  temp = {}
  for remat, scan in [("none", False), ("block", True), ("dots_saveable", True)]:
    compiled = _compiled_backward(dataclasses.replace(base, remat=remat, scan_layers=scan), 2,
                                  512).compile()
    temp[(remat, scan)] = compiled.memory_analysis().temp_size_in_bytes
  print({f"{r}/scan={s}": f"{t / 2**20:.1f} MiB" for (r, s), t in temp.items()})
  assert temp[("block", True)] < 0.5 * temp[("none", False)]
  assert temp[("block", True)] <= temp[("dots_saveable", True)] < 0.75 * temp[("none", False)]


def test_scanned_program_does_not_grow_with_depth():
  """Lowered StableHLO of the backward: unrolled, the dot count grows with the layers (2 -> 8:
  4x the per-layer dots); scanned, it is the same at any depth and the text grows by the
  stacking of the per-layer parameters only."""
  counts, sizes = {}, {}
  for scan in (False, True):
    for n in (2, 8):
      cfg = get_preset("tiny-qwen3", n_layers=n, remat="block", scan_layers=scan)
      text = _compiled_backward(cfg, 2, 64).as_text()
      counts[(scan, n)], sizes[(scan, n)] = text.count("stablehlo.dot_general"), len(text)
  print({f"scan={s} L={n}": (counts[(s, n)], sizes[(s, n)]) for s, n in counts})
  assert counts[(True, 8)] == counts[(True, 2)]
  assert counts[(False, 8)] > 3 * counts[(False, 2)]
  # text per extra layer: unrolled a whole block's forward and backward, scanned the stacking
  assert sizes[(True, 8)] - sizes[(True, 2)] < 0.2 * (sizes[(False, 8)] - sizes[(False, 2)])


def test_cached_calls_ignore_remat_and_scan():
  """Prefill + decode through the KV cache with a remat/scan config equals its no-cache (scanned,
  rematerialised) forward."""
  cfg = get_preset("tiny-qwen3-moe", n_layers=3, moe_layers=(1, 2), remat="block",
                   scan_layers=True)
  graphdef, state = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
  call = jax.jit(lambda state, tokens, positions, cache: nnx.merge(graphdef, state)(
      tokens, positions, cache))
  tokens = jax.random.randint(jax.random.key(3), (2, 10), 0, cfg.vocab_size)
  full, _ = call(state, tokens, default_positions(tokens), None)
  cache = init_cache(cfg, 2, 16)
  logits, cache = call(state, tokens[:, :7], default_positions(tokens[:, :7]), cache)
  outs = [logits]
  for t in range(7, 10):
    step, cache = call(state, tokens[:, t:t + 1], jnp.full((2, 1), t, jnp.int32), cache)
    outs.append(step)
  np.testing.assert_allclose(jnp.concatenate(outs, 1), full, atol=2e-5, rtol=1e-5)


def test_bad_remat_is_refused_naming_the_field():
  with pytest.raises(ValueError, match=r"model\.remat='blocks'"):
    ModelConfig(vocab_size=16, remat="blocks")
  spec = importlib.util.spec_from_file_location("cfg_arith", os.path.join(ROOT, "configs",
                                                                          "arith_tool.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  c = mod.get_config("")
  c.model.remat = "blocks"
  c.model.scan_layers = True
  with pytest.raises(ConfigError) as ei:
    validate_config(c, num_devices=1)
  assert [p.split(" = ")[0] for p in ei.value.problems] == ["config.model.remat"]
  assert "use 'block'" in ei.value.problems[0]


def test_config_fields_reach_the_model_config():
  from sao_jax import pretrained, roles
  spec = importlib.util.spec_from_file_location("cfg_arith2", os.path.join(ROOT, "configs",
                                                                           "arith_tool.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  c = mod.get_config("")
  assert pretrained.model_config(roles.from_config(c).model, 32).remat == "none"
  c.model.remat, c.model.scan_layers = "dots_saveable", True
  mcfg = pretrained.model_config(roles.from_config(c).model, 32)
  assert (mcfg.remat, mcfg.scan_layers) == ("dots_saveable", True)
  # how the forward runs is not part of the model's identity (the SFT cache key)
  assert str(mcfg) == str(dataclasses.replace(mcfg, remat="none", scan_layers=False))
