"""Parity of sao_jax's Qwen3 / Qwen3-MoE with Hugging Face ``transformers`` (PyTorch CPU), and the
safetensors loader / saver (round trip, errors, sharding, bf16)."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from sao_jax.models import hf
from sao_jax.models.transformer import (Transformer, default_positions,
                                        rope_frequencies)
from model_oracles import forward_with_aux, greedy_generate

pytestmark = pytest.mark.slow  # every test here is slow (see pyproject's `slow` marker)

transformers = pytest.importorskip("transformers")

VOCAB = 97


def _hf_dense(**kw):
  c = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=5000.0,
           rms_norm_eps=1e-6, tie_word_embeddings=False, initializer_range=0.15,
           max_position_embeddings=128)
  c.update(kw)
  return transformers.Qwen3Config(**c)


def _hf_moe(**kw):
  c = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=24,
           num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
           num_experts=6, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
           mlp_only_layers=[1], rope_theta=5000.0, tie_word_embeddings=True,
           initializer_range=0.15, max_position_embeddings=128, router_aux_loss_coef=0.01)
  c.update(kw)
  return transformers.Qwen3MoeConfig(**c)


def _save_hf(tmp_path, hf_cfg, cls, seed=0, **save_kw):
  torch.manual_seed(seed)
  model = cls(hf_cfg).eval()
  with torch.no_grad():  # non-trivial norm scales so a swapped/missing norm shows
    for n, p in model.named_parameters():
      if n.endswith("norm.weight"):
        p.add_(0.3 * torch.randn_like(p))
  path = str(tmp_path / "ckpt")
  model.save_pretrained(path, **save_kw)
  return model, path


def _merge(cfg, params):
  graphdef = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))[0]
  return nnx.merge(graphdef, params)


def _batch():
  rng = np.random.default_rng(0)
  tokens = rng.integers(3, VOCAB, size=(3, 11)).astype(np.int64)
  lengths = np.array([11, 7, 4])
  mask = (np.arange(11)[None] < lengths[:, None]).astype(np.int64)
  tokens = np.where(mask > 0, tokens, 0)  # right padding with id 0
  return tokens, mask


CASES = [("qwen3", lambda: _hf_dense(), transformers.Qwen3ForCausalLM),
         ("qwen3_tied", lambda: _hf_dense(tie_word_embeddings=True), transformers.Qwen3ForCausalLM),
         ("qwen3_moe", lambda: _hf_moe(), transformers.Qwen3MoeForCausalLM),
         ("qwen3_moe_unnormed", lambda: _hf_moe(norm_topk_prob=False, decoder_sparse_step=2,
                                                mlp_only_layers=[], tie_word_embeddings=False),
          transformers.Qwen3MoeForCausalLM)]


@pytest.mark.parametrize("name,make_cfg,cls", CASES, ids=[c[0] for c in CASES])
def test_logits_match_transformers_over_padded_batch(tmp_path, name, make_cfg, cls):
  ref, path = _save_hf(tmp_path, make_cfg(), cls)
  cfg, params = hf.load_hf_checkpoint(path)
  if "moe" in name:
    assert cfg.is_moe and cfg.n_experts == 6
    assert cfg.moe_layers == ((0, 2) if name == "qwen3_moe" else (1,))
  tokens, mask = _batch()
  with torch.no_grad():
    out = ref(input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask))
  want = out.logits.numpy()
  model = _merge(cfg, params)
  got, _ = model(jnp.asarray(tokens, jnp.int32), default_positions(jnp.asarray(tokens)),
                 attention_mask=jnp.asarray(mask))
  got_nomask, _ = model(jnp.asarray(tokens, jnp.int32), default_positions(jnp.asarray(tokens)))
  valid = mask.astype(bool)
  diff = np.abs(np.asarray(got) - want)[valid].max()
  assert diff < 1e-4, diff
  # right padding: causality alone hides the pads
  assert np.abs(np.asarray(got_nomask) - want)[valid].max() < 1e-4
  assert np.abs(want).max() > 0.5  # logits are not trivially ~0


@pytest.mark.parametrize("name,make_cfg,cls", CASES[::2], ids=[c[0] for c in CASES[::2]])
def test_greedy_generation_with_kv_cache_equals_transformers_generate(tmp_path, name, make_cfg,
                                                                     cls):
  ref, path = _save_hf(tmp_path, make_cfg(), cls, seed=1)
  cfg, params = hf.load_hf_checkpoint(path)
  model = _merge(cfg, params)
  for prompt in ([5, 17, 42, 8, 8, 61], [90, 3]):
    with torch.no_grad():
      out = ref.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=32,
                         min_new_tokens=32, eos_token_id=None, pad_token_id=0)
    want = out[0, len(prompt):].tolist()
    assert len(want) == 32
    assert greedy_generate(model, prompt, 32) == want
    assert len(set(want)) > 3  # not a degenerate constant sequence


def test_moe_load_balancing_loss_matches_transformers(tmp_path):
  ref, path = _save_hf(tmp_path, _hf_moe(), transformers.Qwen3MoeForCausalLM)
  cfg, params = hf.load_hf_checkpoint(path)
  tokens, mask = _batch()
  with torch.no_grad():
    out = ref(input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask),
              output_router_logits=True)
  _, aux = forward_with_aux(_merge(cfg, params), jnp.asarray(tokens, jnp.int32),
                            default_positions(jnp.asarray(tokens)),
                            attention_mask=jnp.asarray(mask))
  assert aux["router_logits"].shape == (2, 3, 11, 6)
  np.testing.assert_allclose(float(aux["load_balancing_loss"]), float(out.aux_loss), rtol=1e-5)
  np.testing.assert_allclose(np.asarray(aux["router_logits"][0]),
                             out.router_logits[0].numpy().reshape(3, 11, 6), atol=1e-5)


@pytest.mark.parametrize("name,make_cfg,cls", CASES[1:3], ids=[c[0] for c in CASES[1:3]])
def test_round_trip_load_save_load_is_bit_identical(tmp_path, name, make_cfg, cls):
  ref, path = _save_hf(tmp_path, make_cfg(), cls)
  cfg, p1 = hf.load_hf_checkpoint(path)
  out = str(tmp_path / "ours")
  files = hf.save_hf_checkpoint(out, cfg, p1, hf_config=hf.read_hf_config(path),
                                max_shard_bytes=20_000)
  assert len(files) > 1 and os.path.isfile(os.path.join(out, "model.safetensors.index.json"))
  cfg2, p2 = hf.load_hf_checkpoint(out)
  assert cfg2 == cfg
  flat1 = jax.tree_util.tree_flatten_with_path(p1)[0]
  flat2 = dict(jax.tree_util.tree_flatten_with_path(p2)[0])
  assert len(flat1) == len(flat2)
  for k, v in flat1:
    assert np.asarray(v).tobytes() == np.asarray(flat2[k]).tobytes(), k
  # the files hold the same tensors, bit for bit, as transformers wrote
  from safetensors import safe_open
  with safe_open(os.path.join(path, "model.safetensors"), "numpy") as f:
    orig = {k: f.get_tensor(k) for k in f.keys()}
  for fn in files:
    with safe_open(fn, "numpy") as f:
      for k in f.keys():
        assert f.get_tensor(k).tobytes() == orig[k].tobytes(), k
  # and transformers reads what we wrote
  back = cls.from_pretrained(out).eval()
  tokens, _ = _batch()
  with torch.no_grad():
    np.testing.assert_array_equal(back(input_ids=torch.tensor(tokens)).logits.numpy(),
                                  ref(input_ids=torch.tensor(tokens)).logits.numpy())


def test_sharded_checkpoint_written_by_transformers_loads(tmp_path):
  ref, path = _save_hf(tmp_path, _hf_moe(), transformers.Qwen3MoeForCausalLM,
                       max_shard_size="20KB")
  assert os.path.isfile(os.path.join(path, "model.safetensors.index.json"))
  cfg, params = hf.load_hf_checkpoint(path)
  tokens, _ = _batch()
  with torch.no_grad():
    want = ref(input_ids=torch.tensor(tokens)).logits.numpy()
  got, _ = _merge(cfg, params)(jnp.asarray(tokens, jnp.int32),
                               default_positions(jnp.asarray(tokens)))
  assert np.abs(np.asarray(got) - want).max() < 1e-4


def _rewrite(path, fn):
  from safetensors.numpy import save_file
  from safetensors import safe_open
  f = os.path.join(path, "model.safetensors")
  with safe_open(f, "numpy") as r:
    t = {k: r.get_tensor(k) for k in r.keys()}
  fn(t)
  save_file(t, f, metadata={"format": "pt"})


def test_loader_names_missing_tensor(tmp_path):
  _, path = _save_hf(tmp_path, _hf_dense(), transformers.Qwen3ForCausalLM)
  _rewrite(path, lambda t: t.pop("model.layers.1.self_attn.k_norm.weight"))
  with pytest.raises(ValueError, match=r"missing tensor 'model\.layers\.1\.self_attn\.k_norm"):
    hf.load_hf_checkpoint(path)


def test_loader_names_mismatched_shape(tmp_path):
  _, path = _save_hf(tmp_path, _hf_dense(), transformers.Qwen3ForCausalLM)
  conf = hf.read_hf_config(path)
  conf["intermediate_size"] = 40
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(conf, f)
  with pytest.raises(ValueError, match=r"mlp\.(gate|up|down)_proj\.weight' has shape .*expects"):
    hf.load_hf_checkpoint(path)


def test_loader_rejects_unexpected_tensor_and_bad_folders(tmp_path):
  _, path = _save_hf(tmp_path, _hf_dense(), transformers.Qwen3ForCausalLM)
  _rewrite(path, lambda t: t.update({"model.layers.2.mlp.up_proj.weight": np.zeros((2, 2))}))
  with pytest.raises(ValueError, match=r"unexpected tensor 'model\.layers\.2\.mlp\.up_proj"):
    hf.load_hf_checkpoint(path)
  with pytest.raises(FileNotFoundError, match="does not exist"):
    hf.load_hf_checkpoint(str(tmp_path / "nope"))
  empty = tmp_path / "empty"
  empty.mkdir()
  with pytest.raises(FileNotFoundError, match="no config.json"):
    hf.load_hf_checkpoint(str(empty))
  (empty / "config.json").write_text("{}")
  with pytest.raises(FileNotFoundError, match="no model.safetensors"):
    hf.load_hf_checkpoint(str(empty))


def test_unsupported_architecture_is_named():
  conf = _hf_dense().to_dict()
  conf["architectures"] = ["GPT2LMHeadModel"]
  with pytest.raises(ValueError, match=r"unsupported architecture 'GPT2LMHeadModel'.*Qwen3"):
    hf.config_from_hf(conf)
  conf["architectures"], conf["model_type"] = None, "mamba"
  with pytest.raises(ValueError, match="unsupported model_type 'mamba'"):
    hf.config_from_hf(conf)


# Documented tolerance: bf16 params + bf16 activations (RMSNorm, softmax, RoPE and logits in
# float32) keep logits within 0.08 absolute (~2% of the logit range of these models) of float32
# and agree on the argmax almost everywhere.
BF16_MAX_ABS = 0.08


def test_bf16_forward_within_documented_tolerance_of_float32(tmp_path):
  _, path = _save_hf(tmp_path, _hf_moe(), transformers.Qwen3MoeForCausalLM)
  cfg32, p32 = hf.load_hf_checkpoint(path)
  cfg16, p16 = hf.load_hf_checkpoint(path, dtype="bfloat16", param_dtype="bfloat16")
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(p16))
  tokens, _ = _batch()
  t = jnp.asarray(tokens, jnp.int32)
  l32, _ = _merge(cfg32, p32)(t, default_positions(t))
  l16, _ = _merge(cfg16, p16)(t, default_positions(t))
  assert l16.dtype == jnp.float32
  diff = float(jnp.max(jnp.abs(l16 - l32)))
  assert 0 < diff < BF16_MAX_ABS, diff
  assert float(jnp.mean(jnp.argmax(l16, -1) == jnp.argmax(l32, -1))) >= 0.9


@pytest.mark.parametrize("scaling", [
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
])
def test_rope_scaling_frequencies_match_transformers(scaling):
  from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
  hcfg = _hf_dense(rope_scaling=dict(scaling), rope_theta=5000.0)
  cfg = hf.config_from_hf(hcfg.to_dict())
  assert cfg.rope_scaling_dict()["rope_type"] == scaling["rope_type"]
  inv, scale = rope_frequencies(cfg)
  want_inv, want_scale = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hcfg, "cpu")
  np.testing.assert_allclose(inv, want_inv.numpy(), rtol=1e-5)
  assert scale == pytest.approx(want_scale)
