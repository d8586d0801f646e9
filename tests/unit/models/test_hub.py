"""Hugging Face hub ids as model.checkpoint_dir (sao_jax/hub.py), read from a hub cache folder made
in the test (the hub's layout: models--<owner>--<name>/refs/main + snapshots/<commit>/), offline:
no network is used."""

import json
import os
import types

import numpy as np
import pytest
from flax import nnx
from huggingface_hub import constants

from sao_jax import configs, hub, pretrained, roles
from sao_jax.models import hf, presets
from sao_jax.models.transformer import Transformer
from sao_jax.train.validation import checkpoint_dir_problems

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _tokenizer_files(path):
  """A small byte-level BPE (tokenizer.json + tokenizer_config.json); returns its vocab size."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # pylint: disable=import-outside-toplevel
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_end|>"],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(["Compute 347*29-118.", "The answer is \\boxed{9945}."] * 5, trainer)
  tok.save(os.path.join(path, "tokenizer.json"))
  with open(os.path.join(path, "tokenizer_config.json"), "w", encoding="utf-8") as f:
    json.dump({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None}, f)
  return tok.get_vocab_size()


@pytest.fixture(name="offline_cache")
def fixture_offline_cache(tmp_path, monkeypatch):
  """A hub cache holding ``tiny-org/tiny-qwen3`` (a 1-layer Qwen3 saved by ``save_hf_checkpoint``),
  set as the hub's cache, with the hub offline (HF_HUB_OFFLINE=1)."""
  cache = tmp_path / "hub"
  snapshot = cache / "models--tiny-org--tiny-qwen3" / "snapshots" / COMMIT
  os.makedirs(snapshot)
  (cache / "models--tiny-org--tiny-qwen3" / "refs").mkdir()
  (cache / "models--tiny-org--tiny-qwen3" / "refs" / "main").write_text(COMMIT)
  vocab = _tokenizer_files(str(snapshot))
  cfg = presets.get_preset("tiny-qwen3", vocab_size=vocab, d_model=32, head_dim=8, d_ff=64,
                           n_layers=1, max_seq_len=64)
  params = nnx.to_pure_dict(nnx.split(Transformer(cfg, rngs=nnx.Rngs(3)))[1])
  hf.save_hf_checkpoint(str(snapshot), cfg, params)
  monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
  monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
  hub.resolve_checkpoint_dir.cache_clear()
  yield types.SimpleNamespace(cache=str(cache), snapshot=str(snapshot), params=params, vocab=vocab)
  hub.resolve_checkpoint_dir.cache_clear()


def test_hub_id_is_told_from_paths(tmp_path):
  assert hub.is_hub_id("Qwen/Qwen3-0.6B")
  assert hub.is_hub_id("HuggingFaceTB/SmolLM2-135M-Instruct")
  assert not hub.is_hub_id("")
  assert not hub.is_hub_id(str(tmp_path))                 # an existing folder
  assert not hub.is_hub_id("runs/arith_tool/checkpoints")  # two slashes: a path
  assert not hub.is_hub_id("./a/b") and not hub.is_hub_id("/a/b") and not hub.is_hub_id("~/x")
  os.makedirs(tmp_path / "org" / "name")
  cwd = os.getcwd()
  try:
    os.chdir(tmp_path)
    assert not hub.is_hub_id("org/name")                  # an existing relative folder wins
    assert hub.resolve_checkpoint_dir("org/name") == "org/name"
  finally:
    os.chdir(cwd)


def test_hub_id_resolves_to_the_cached_snapshot_offline(offline_cache):
  assert hub.resolve_checkpoint_dir("tiny-org/tiny-qwen3") == offline_cache.snapshot
  # an explicit cache folder, the default cache pointing elsewhere
  assert hub.resolve_checkpoint_dir.__wrapped__(
      "tiny-org/tiny-qwen3", cache_dir=offline_cache.cache) == offline_cache.snapshot


def test_model_loads_from_a_hub_id_offline(offline_cache):
  config = configs.load("aime", "smoke")
  config.model.checkpoint_dir = "tiny-org/tiny-qwen3"
  assert checkpoint_dir_problems(config.model.checkpoint_dir) == []
  model = roles.from_config(config).model
  assert pretrained.source(model) == "hf"
  assert pretrained.checkpoint_dir(model) == offline_cache.snapshot
  assert pretrained.load_tokenizer(model).vocab_size == offline_cache.vocab
  mcfg, params = pretrained.load_model(model)
  assert (mcfg.n_layers, mcfg.d_model, mcfg.vocab_size) == (1, 32, offline_cache.vocab)
  want = offline_cache.params["embed"]["embedding"]
  np.testing.assert_array_equal(np.asarray(params["embed"]["embedding"]), np.asarray(want))


def test_unknown_hub_id_offline_names_the_field(offline_cache):
  with pytest.raises(FileNotFoundError) as e:
    hub.resolve_checkpoint_dir("tiny-org/not-cached")
  msg = str(e.value)
  assert "config.model.checkpoint_dir = 'tiny-org/not-cached'" in msg
  assert offline_cache.cache in msg and "HF_HUB_OFFLINE=1" in msg and "fix:" in msg
  problems = checkpoint_dir_problems("tiny-org/not-cached")
  assert len(problems) == 1 and problems[0].startswith("config.model.checkpoint_dir = ")
