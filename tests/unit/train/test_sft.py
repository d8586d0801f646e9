"""The SFT warm-up: deterministic given its seed, and cached across runs (sft.cache_dir)."""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sao_jax.models.transformer import ModelConfig, Transformer
from sao_jax.train import sft


def _model():
  cfg = ModelConfig(vocab_size=16, d_model=16, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=8,
                    d_ff=32, max_seq_len=16)
  graphdef, state = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
  return graphdef, nnx.to_pure_dict(state)


DEMOS = [([1, 2, 3, 4, 5], [0, 0, 1, 1, 1]), ([1, 3, 5, 7], [0, 1, 1, 1])] * 4


def _train(graphdef, params, calls):
  calls.append(1)
  params = jax.tree.map(jnp.copy, params)  # train_sft donates its input buffers
  return sft.train_sft(graphdef, params, DEMOS, pad_id=0, steps_=3, batch_size=4, lr=1e-2, seed=7)


@pytest.mark.slow
def test_sft_is_deterministic_and_the_cache_returns_the_same_bits(tmp_path):
  graphdef, params = _model()
  calls = []
  a, loss_a = sft.cached_sft(str(tmp_path), "k1", params, lambda: _train(graphdef, params, calls))
  b, loss_b = sft.cached_sft(str(tmp_path), "k1", params, lambda: _train(graphdef, params, calls))
  c, _ = _train(graphdef, params, calls)  # retrained without the cache
  assert len(calls) == 2  # the second cached call loaded the file instead of training
  assert np.isfinite(loss_a) and np.isnan(loss_b)
  assert os.listdir(tmp_path) == ["sft-k1.safetensors"]  # no temporary file left behind
  assert jax.tree.structure(a) == jax.tree.structure(b) == jax.tree.structure(params)
  for x, y, z, p in zip(jax.tree.leaves(a), jax.tree.leaves(b), jax.tree.leaves(c),
                        jax.tree.leaves(params)):
    assert np.array_equal(np.asarray(x), np.asarray(y)) and np.array_equal(np.asarray(x),
                                                                         np.asarray(z))
    assert np.asarray(x).dtype == np.asarray(p).dtype
  moved = sum(not np.array_equal(np.asarray(x), np.asarray(p))
              for x, p in zip(jax.tree.leaves(a), jax.tree.leaves(params)))
  assert moved >= 10  # SFT really trained
  # another key trains again; "" disables the cache
  sft.cached_sft(str(tmp_path), "k2", params, lambda: _train(graphdef, params, calls))
  sft.cached_sft("", "k1", params, lambda: _train(graphdef, params, calls))
  assert len(calls) == 4


@pytest.mark.slow
def test_sft_cache_for_another_model_is_refused_with_the_file_name(tmp_path):
  graphdef, params = _model()
  sft.cached_sft(str(tmp_path), "k", params, lambda: _train(graphdef, params, []))
  other = dict(params)
  other.pop("embed")
  with pytest.raises(ValueError, match=r"sft-k\.safetensors.*delete the file"):
    sft.cached_sft(str(tmp_path), "k", other, lambda: (other, 0.0))


def test_cache_key_changes_with_any_part():
  base = sft.cache_key({"steps": 10}, {"name": "arith_tool"}, 0)
  assert base == sft.cache_key({"steps": 10}, {"name": "arith_tool"}, 0)
  assert base != sft.cache_key({"steps": 11}, {"name": "arith_tool"}, 0)
  assert base != sft.cache_key({"steps": 10}, {"name": "arith_tool"}, 1)


def test_warm_start_identity_ignores_where_it_is_cached_and_the_prompt_pool():
  """``build.sft_key``: the same warm start whatever ``sft.cache_dir``, ``task.prompt_pool`` or the
  tool latency (so every cell of an experiment shares it); another demo set (``task.n_train``)
  is another."""
  from sao_jax import build, configs, roles  # pylint: disable=import-outside-toplevel
  c = configs.load("chain_tool")
  key = lambda: build.sft_key(roles.from_config(c), "model")
  base = key()
  c.sft.cache_dir, c.task.prompt_pool = "elsewhere", 128
  c.task.tool_latency_median_s, c.task.tool_latency_sigma = 0.2, 0.5  # same demonstrations
  assert key() == base
  c.task.n_train = 100
  assert key() != base
  # a task field added later with a default keeps the identity of every earlier warm start
  run = roles.from_config(c)
  grown = dataclasses.make_dataclass("GrownTask", [("new_field", int, dataclasses.field(
      default=7))], bases=(type(run.task),), frozen=True)
  wider = dataclasses.replace(run, task=grown(**dataclasses.asdict(run.task)))
  assert build.sft_key(wider, "model") == build.sft_key(run, "model")
  changed = dataclasses.replace(run, task=grown(**dataclasses.asdict(run.task), new_field=8))
  assert build.sft_key(changed, "model") != build.sft_key(run, "model")
