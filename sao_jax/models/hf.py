"""Hugging Face checkpoint folders <-> sao_jax params (Qwen3, Qwen3-MoE, Llama layouts).

A checkpoint folder holds ``config.json`` and either ``model.safetensors`` or shards
``model-XXXXX-of-YYYYY.safetensors`` with ``model.safetensors.index.json`` (the layout
``transformers``' ``save_pretrained`` writes). Loading is lazy: one tensor is read at a time from
its (memory-mapped) shard, transposed into our ``[in, out]`` layout, cast to
``ModelConfig.param_dtype`` and placed before the next is read. With target shardings (the
learner's mesh) each device receives only its slice (``jax.make_array_from_callback``), so no
device ever holds more than its shards. MoE expert tensors
(``mlp.experts.{e}.{gate,up,down}_proj.weight``) are read one projection of one layer at a time
and stacked into one ``[n_experts, ...]`` host buffer before it is placed.

Name mapping (HF -> ours; ``W.T`` means the torch ``[out, in]`` weight is transposed):

=============================================  ==============================================
``model.embed_tokens.weight``                  ``embed/embedding``
``model.layers.{i}.input_layernorm.weight``    ``layers/{i}/attn_norm/scale``
``model.layers.{i}.self_attn.{q,k,v,o}_proj``  ``layers/{i}/attn/{q,k,v,o}_proj/{kernel=W.T,bias}``
``model.layers.{i}.self_attn.{q,k}_norm``      ``layers/{i}/attn/{q,k}_norm/scale``
``model.layers.{i}.post_attention_layernorm``  ``layers/{i}/mlp_norm/scale``
``model.layers.{i}.mlp.{gate,up,down}_proj``   ``layers/{i}/mlp/{gate,up,down}_proj/kernel`` (W.T)
``model.layers.{i}.mlp.gate.weight``           ``layers/{i}/mlp/router/kernel`` (W.T, MoE)
``model.layers.{i}.mlp.experts.{e}.X.weight``  ``layers/{i}/mlp/X[e]`` (W.T, MoE)
``model.norm.weight``                          ``final_norm/scale``
``lm_head.weight``                             ``lm_head/kernel`` (W.T; absent when tied)
=============================================  ==============================================
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
from typing import Any, Iterable, Iterator, Optional

import jax
import numpy as np
from flax import nnx

from sao_jax.models.transformer import ModelConfig, Transformer
from safetensors import safe_open
from safetensors.numpy import save_file

SUPPORTED_ARCHITECTURES = {
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "LlamaForCausalLM": "llama",
}
# tensors some checkpoints carry that the model recomputes
_IGNORED = (re.compile(r"\.rotary_emb\.inv_freq$"),)


# ---------------------------------------------------------------------------------------------
# config.json
# ---------------------------------------------------------------------------------------------
def config_from_hf(hf: dict, *, max_seq_len: Optional[int] = None, dtype: str = "float32",
                   param_dtype: str = "float32") -> ModelConfig:
  """``ModelConfig`` from a Hugging Face ``config.json`` dict (transformers 4.x or 5.x keys).

  Args:
    hf: the parsed ``config.json``.
    max_seq_len: longest sequence used (default: ``max_position_embeddings``).
    dtype / param_dtype: compute and parameter dtype names.
  Raises:
    ValueError: unsupported architecture / model_type, or a feature this code does not
      implement (non-SiLU activation, sliding-window attention, MLP bias), naming the field.
  """
  archs = hf.get("architectures") or []
  for a in archs:
    if a not in SUPPORTED_ARCHITECTURES:
      raise ValueError(f"unsupported architecture {a!r} in config.json; sao_jax loads "
                       f"{sorted(SUPPORTED_ARCHITECTURES)}.")
  model_type = hf.get("model_type")
  if model_type not in SUPPORTED_ARCHITECTURES.values():
    raise ValueError(f"unsupported model_type {model_type!r} in config.json; sao_jax loads "
                     f"{sorted(set(SUPPORTED_ARCHITECTURES.values()))}.")
  act = hf.get("hidden_act", "silu")
  if act != "silu":
    raise ValueError(f"config.json hidden_act={act!r}: only 'silu' (SwiGLU) is implemented.")
  if hf.get("use_sliding_window"):
    raise ValueError("config.json use_sliding_window=true: sliding-window attention is not "
                     "implemented; set it to false.")
  if hf.get("mlp_bias"):
    raise ValueError("config.json mlp_bias=true is not implemented.")
  rp = dict(hf.get("rope_parameters") or {})
  theta = float(rp.get("rope_theta", hf.get("rope_theta", 10000.0)))
  scaling = dict(hf.get("rope_scaling") or {})
  if not scaling and rp:
    scaling = {k: v for k, v in rp.items() if k != "rope_theta"}
  if "type" in scaling and "rope_type" not in scaling:
    scaling["rope_type"] = scaling.pop("type")
  if scaling.get("rope_type", "default") == "default":
    scaling = {}
  n_heads = int(hf["num_attention_heads"])
  d_model = int(hf["hidden_size"])
  n_layers = int(hf["num_hidden_layers"])
  head_dim = int(hf.get("head_dim") or d_model // n_heads)
  moe_kw = {}
  if model_type == "qwen3_moe":
    n_exp = int(hf.get("num_experts", hf.get("num_local_experts", 0)) or 0)
    step = int(hf.get("decoder_sparse_step", 1) or 1)
    only = set(int(i) for i in (hf.get("mlp_only_layers") or []))
    layers = tuple(i for i in range(n_layers)
                   if i not in only and n_exp > 0 and (i + 1) % step == 0)
    moe_kw = dict(n_experts=n_exp, n_experts_per_tok=int(hf["num_experts_per_tok"]),
                  moe_d_ff=int(hf["moe_intermediate_size"]), moe_layers=layers,
                  norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                  router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.0) or 0.0))
  bias = bool(hf.get("attention_bias", False))
  return ModelConfig(
      vocab_size=int(hf["vocab_size"]), d_model=d_model, n_layers=n_layers, n_heads=n_heads,
      n_kv_heads=int(hf.get("num_key_value_heads") or n_heads), head_dim=head_dim,
      d_ff=int(hf["intermediate_size"]), rope_theta=theta,
      rms_eps=float(hf.get("rms_norm_eps", 1e-6)),
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
      qk_norm=model_type in ("qwen3", "qwen3_moe"),
      max_seq_len=int(max_seq_len or hf.get("max_position_embeddings", 4096)),
      dtype=dtype, param_dtype=param_dtype, arch=model_type, attention_bias=bias, o_bias=bias,
      rope_scaling=tuple(sorted(scaling.items())) if scaling else None, **moe_kw)


def config_to_hf(cfg: ModelConfig) -> dict:
  """A ``config.json`` dict (transformers 4.x keys, which 5.x also reads) for ``cfg``."""
  arch = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}[cfg.arch]
  out = {
      "architectures": [arch], "model_type": cfg.arch, "vocab_size": cfg.vocab_size,
      "hidden_size": cfg.d_model, "intermediate_size": cfg.d_ff,
      "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
      "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
      "rms_norm_eps": cfg.rms_eps, "rope_theta": cfg.rope_theta,
      "rope_scaling": cfg.rope_scaling_dict() or None,
      "tie_word_embeddings": cfg.tie_embeddings, "max_position_embeddings": cfg.max_seq_len,
      "attention_bias": cfg.attention_bias, "torch_dtype": cfg.param_dtype,
  }
  if cfg.arch == "qwen3_moe":
    out.update(num_experts=cfg.n_experts, num_experts_per_tok=cfg.n_experts_per_tok,
               moe_intermediate_size=cfg.moe_d_ff, norm_topk_prob=cfg.norm_topk_prob,
               decoder_sparse_step=1, router_aux_loss_coef=cfg.router_aux_loss_coef,
               mlp_only_layers=[i for i in range(cfg.n_layers) if i not in cfg.moe_layers])
  return out


# ---------------------------------------------------------------------------------------------
# name mapping
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Target:
  path: tuple        # key path into the pure params dict, e.g. ("layers", 0, "attn", ...)
  transpose: bool    # HF stores [out, in]; we store [in, out]
  expert: Optional[int] = None  # index into the stacked expert axis


def path_str(path: tuple) -> str:
  return "/".join(str(p) for p in path)


def hf_name_map(cfg: ModelConfig) -> dict[str, _Target]:
  """HF tensor name -> where it goes in our params (see the module docstring's table)."""
  m: dict[str, _Target] = {"model.embed_tokens.weight": _Target(("embed", "embedding"), False),
                           "model.norm.weight": _Target(("final_norm", "scale"), False)}
  if not cfg.tie_embeddings:
    m["lm_head.weight"] = _Target(("lm_head", "kernel"), True)
  for i in range(cfg.n_layers):
    h, p = f"model.layers.{i}", ("layers", i)
    m[f"{h}.input_layernorm.weight"] = _Target(p + ("attn_norm", "scale"), False)
    m[f"{h}.post_attention_layernorm.weight"] = _Target(p + ("mlp_norm", "scale"), False)
    for x in ("q", "k", "v", "o"):
      m[f"{h}.self_attn.{x}_proj.weight"] = _Target(p + ("attn", f"{x}_proj", "kernel"), True)
      if (cfg.attention_bias and x != "o") or (cfg.o_bias and x == "o"):
        m[f"{h}.self_attn.{x}_proj.bias"] = _Target(p + ("attn", f"{x}_proj", "bias"), False)
    if cfg.qk_norm:
      for x in ("q", "k"):
        m[f"{h}.self_attn.{x}_norm.weight"] = _Target(p + ("attn", f"{x}_norm", "scale"), False)
    if i in cfg.moe_layers:
      m[f"{h}.mlp.gate.weight"] = _Target(p + ("mlp", "router", "kernel"), True)
      for e in range(cfg.n_experts):
        for x in ("gate", "up", "down"):
          m[f"{h}.mlp.experts.{e}.{x}_proj.weight"] = _Target(p + ("mlp", f"{x}_proj"), True, e)
    else:
      for x in ("gate", "up", "down"):
        m[f"{h}.mlp.{x}_proj.weight"] = _Target(p + ("mlp", f"{x}_proj", "kernel"), True)
  return m


def param_shapes(cfg: ModelConfig) -> dict:
  """Pure dict of ``jax.ShapeDtypeStruct`` of a ``Transformer(cfg)`` (nothing allocated)."""
  abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  return nnx.to_pure_dict(nnx.split(abstract)[1])


def _get(tree, path):
  for k in path:
    tree = tree[k]
  return tree


def _set(tree, path, value):
  for k in path[:-1]:
    tree = tree.setdefault(k, {})
  tree[path[-1]] = value


def _hf_shape(target: _Target, shape: tuple) -> tuple:
  if target.expert is not None:
    shape = shape[1:]
  return tuple(reversed(shape)) if target.transpose else tuple(shape)


def _aligned_empty(shape, dtype, align: int = 64) -> np.ndarray:
  """Uninitialised array whose data is ``align``-byte aligned (XLA's CPU client then adopts it
  without a copy)."""
  dtype = np.dtype(dtype)
  n = int(np.prod(shape)) * dtype.itemsize
  raw = np.empty(n + align, np.uint8)
  off = (-raw.ctypes.data) % align
  return raw[off:off + n].view(dtype).reshape(shape)


# ---------------------------------------------------------------------------------------------
# assembling params from a stream of named tensors
# ---------------------------------------------------------------------------------------------
def params_from_tensors(cfg: ModelConfig, tensors: Iterable[tuple[str, Any]], *,
                        available: Optional[Iterable[str]] = None, shardings: Any = None,
                        source: str = "checkpoint") -> dict:
  """Builds the pure params dict from ``(hf_name, array)`` pairs read one at a time.

  Args:
    cfg: the model config (fixes every expected name and shape).
    tensors: iterable of (HF tensor name, numpy-compatible array [HF layout]); consumed lazily.
    available: all tensor names the source holds (checked before anything is read, so a missing
      tensor fails fast); default: checked after the stream is consumed.
    shardings: None (default device), a pytree like the params of ``jax.sharding.Sharding``, or
      a callable ``path_str -> Sharding``. With a sharding each device receives only its slice
      of each tensor (``jax.make_array_from_callback``; the host holds the tensor being placed
      -- one stacked expert tensor for MoE experts -- and one device's slice of it).
    source: what to call the source in error messages.
  Returns: pure dict of ``jax.Array`` in ``cfg.param_dtype``.
  Raises ValueError naming the missing / unexpected tensor or the mismatched shape.
  """
  names = hf_name_map(cfg)
  shapes = param_shapes(cfg)
  pdt = np.dtype(cfg.params_dtype)

  def check_names(have):
    have = set(have)
    missing = sorted(n for n in names if n not in have)
    if missing:
      raise ValueError(f"{source} is missing tensor {missing[0]!r}"
                       + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
                       + f" needed by the {cfg.arch} config; is the folder complete?")

  if available is not None:
    check_names(available)

  def sharding_for(path):
    if shardings is None:
      return None
    if callable(shardings):
      return shardings(path_str(path))
    return _get(shardings, path)

  def host_copy(src):
    # transpose + cast into a 64-byte aligned buffer: on CPU, device_put then aliases it
    dest = _aligned_empty(src.shape, pdt)
    np.copyto(dest, src, casting="unsafe")
    return dest

  def place(path, src, owned=False):
    """``src`` (host, our layout, any dtype; ``owned``: an aligned ``pdt`` buffer of ours) -> a
    jax.Array in ``pdt``: with a sharding, each device gets a copy of only its slice; else one
    copy on the default device."""
    s = sharding_for(path)
    if s is None:
      return jax.device_put(src if owned else host_copy(src))
    return jax.make_array_from_callback(src.shape, s, lambda index: host_copy(src[index]))

  out: dict = {}
  pending: dict[tuple, list] = {}  # stacked expert buffers: path -> [buffer, n_filled]
  seen = set()
  for name, arr in tensors:
    if any(p.search(name) for p in _IGNORED):
      continue
    if name not in names:
      if cfg.tie_embeddings and name == "lm_head.weight":
        continue  # some tied checkpoints also store the (identical) head
      raise ValueError(f"{source} has unexpected tensor {name!r} for the {cfg.arch} config "
                       f"(wrong model_type or layer count in config.json?).")
    t = names[name]
    full = tuple(_get(shapes, t.path).shape)
    want = _hf_shape(t, full)
    if tuple(arr.shape) != want:
      raise ValueError(f"{source} tensor {name!r} has shape {tuple(arr.shape)}, the config "
                       f"expects {want}; config.json and weights disagree.")
    a = np.asarray(arr)
    if t.transpose:
      a = a.T
    if t.expert is None:
      _set(out, t.path, place(t.path, a))
    else:
      buf = pending.get(t.path)
      if buf is None:
        buf = pending[t.path] = [_aligned_empty(full, pdt), 0]
      np.copyto(buf[0][t.expert], a, casting="unsafe")
      buf[1] += 1
      if buf[1] == cfg.n_experts:
        _set(out, t.path, place(t.path, buf[0], owned=True))
        del pending[t.path]
    seen.add(name)
    del a, arr
  check_names(seen)
  return out


# ---------------------------------------------------------------------------------------------
# safetensors folders
# ---------------------------------------------------------------------------------------------
def checkpoint_files(path: str) -> list[str]:
  """The safetensors files of a checkpoint folder, in shard order.

  Raises FileNotFoundError naming what is missing (config.json, weights, a shard in the index)."""
  if not os.path.isdir(path):
    raise FileNotFoundError(f"checkpoint folder {path!r} does not exist.")
  if not os.path.isfile(os.path.join(path, "config.json")):
    raise FileNotFoundError(f"{path!r} has no config.json; is it a Hugging Face checkpoint "
                            f"folder?")
  single = os.path.join(path, "model.safetensors")
  index = os.path.join(path, "model.safetensors.index.json")
  if os.path.isfile(index):
    with open(index, encoding="utf-8") as f:
      files = sorted(set(json.load(f)["weight_map"].values()))
    for fn in files:
      if not os.path.isfile(os.path.join(path, fn)):
        raise FileNotFoundError(f"shard {fn!r} listed in model.safetensors.index.json is missing "
                                f"from {path!r}.")
    return [os.path.join(path, fn) for fn in files]
  if os.path.isfile(single):
    return [single]
  shards = sorted(glob.glob(os.path.join(path, "model-*.safetensors")))
  if shards:
    return shards
  raise FileNotFoundError(f"{path!r} has no model.safetensors, no model-*.safetensors shards "
                          f"and no model.safetensors.index.json.")


def read_hf_config(path: str) -> dict:
  with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
    return json.load(f)


def _stream(files: list[str], order: Iterable[str] = ()) -> Iterator[tuple[str, np.ndarray]]:
  """(name, tensor) of every tensor of ``files``: names the files hold but ``order`` does not
  first (an unexpected tensor fails before anything is placed), then ``order``'s. A shard is
  opened (memory-mapped) when first needed and closed once its last tensor is read."""
  where: dict[str, str] = {}
  left: dict[str, int] = {}
  for fn in files:
    with safe_open(fn, framework="numpy") as f:
      keys = list(f.keys())
    where.update((k, fn) for k in keys)
    left[fn] = len(keys)
  order = [n for n in order if n in where]
  wanted = set(order)
  handles: dict[str, Any] = {}
  try:
    for name in [n for n in where if n not in wanted] + order:
      fn = where[name]
      if fn not in handles:
        handles[fn] = safe_open(fn, framework="numpy")
      arr = handles[fn].get_tensor(name)
      left[fn] -= 1
      if not left[fn]:
        del handles[fn]
      yield name, arr
      del arr
  finally:
    handles.clear()


def _grouped_names(cfg: ModelConfig) -> list[str]:
  """The HF tensor names of ``cfg`` with the experts of one (layer, projection) together, so
  one stacked expert buffer is filled at a time."""
  groups: dict[tuple, list[str]] = {}
  for name, t in hf_name_map(cfg).items():
    groups.setdefault(t.path, []).append(name)
  return [n for names in groups.values() for n in names]


def load_hf_checkpoint(path: str, *, max_seq_len: Optional[int] = None, dtype: str = "float32",
                       param_dtype: str = "float32", shardings: Any = None
                       ) -> tuple[ModelConfig, dict]:
  """Loads ``(ModelConfig, params)`` from a Hugging Face checkpoint folder, lazily.

  Tensors are read one at a time (MoE experts one stacked projection at a time); a shard stays
  memory-mapped until its last tensor is read. Peak host memory is about one shard plus the
  params when they land on a CPU device (see ``benchmarks/load_memory.py``). ``shardings``: as
  in ``params_from_tensors`` (e.g. ``sao_jax.train.sharding.param_shardings(param_shapes(cfg),
  mesh)``: each device then receives only its slices, as ``sao_jax.pretrained.load_model``
  does for the learner's mesh).
  Raises FileNotFoundError (folder / config / shard missing), ValueError (unsupported
  architecture, missing or unexpected tensor, shape mismatch: each names the tensor).
  """
  files = checkpoint_files(path)
  cfg = config_from_hf(read_hf_config(path), max_seq_len=max_seq_len, dtype=dtype,
                       param_dtype=param_dtype)
  available = []
  for fn in files:
    with safe_open(fn, framework="numpy") as f:
      available.extend(f.keys())
  params = params_from_tensors(cfg, _stream(files, _grouped_names(cfg)), available=available,
                               shardings=shardings, source=f"checkpoint {path!r}")
  return cfg, params


def hf_tensors(cfg: ModelConfig, params: dict) -> Iterator[tuple[str, np.ndarray]]:
  """(HF name, numpy array in HF layout) for every parameter, one at a time (host copies)."""
  for name, t in hf_name_map(cfg).items():
    a = _get(params, t.path)
    if t.expert is not None:
      a = a[t.expert]
    a = np.asarray(jax.device_get(a))
    yield name, np.ascontiguousarray(a.T if t.transpose else a)


def save_hf_checkpoint(path: str, cfg: ModelConfig, params: dict, *,
                       hf_config: Optional[dict] = None,
                       max_shard_bytes: int = 2 << 30) -> list[str]:
  """Writes ``params`` as a Hugging Face checkpoint folder (``transformers`` and vLLM read it).

  Tensors are written in ``cfg.param_dtype``'s bytes as stored in ``params`` (bit-exact round
  trip), in shards of at most ``max_shard_bytes`` (one file ``model.safetensors`` when it fits;
  otherwise ``model-XXXXX-of-YYYYY.safetensors`` + ``model.safetensors.index.json``), one shard in
  host memory at a time. ``hf_config``: the original ``config.json`` dict to keep (its other keys,
  e.g. token ids, survive); default ``config_to_hf(cfg)``. Returns the written weight files.
  """
  os.makedirs(path, exist_ok=True)
  shards: list[dict] = [{}]
  size = 0
  # first pass only sizes the shards, so the file names can say "-of-N"
  plan: list[list[str]] = [[]]
  for name, t in hf_name_map(cfg).items():
    a = _get(params, t.path)
    nbytes = a.dtype.itemsize * int(np.prod(a.shape[1:] if t.expert is not None else a.shape))
    if plan[-1] and size + nbytes > max_shard_bytes:
      plan.append([])
      size = 0
    plan[-1].append(name)
    size += nbytes
  del shards
  n = len(plan)
  files, weight_map = [], {}
  stream = hf_tensors(cfg, params)
  for k, names in enumerate(plan):
    fn = "model.safetensors" if n == 1 else f"model-{k + 1:05d}-of-{n:05d}.safetensors"
    shard = {}
    for _ in names:
      name, arr = next(stream)
      shard[name] = arr
      weight_map[name] = fn
    save_file(shard, os.path.join(path, fn), metadata={"format": "pt"})
    files.append(os.path.join(path, fn))
    del shard
  if n > 1:
    total = sum(_get(params, t.path).dtype.itemsize * int(np.prod(_get(params, t.path).shape))
                for t in {t.path: t for t in hf_name_map(cfg).values()}.values())
    with open(os.path.join(path, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
      json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
  conf = dict(hf_config) if hf_config is not None else config_to_hf(cfg)
  conf["torch_dtype"] = cfg.param_dtype
  with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
    json.dump(conf, f, indent=2)
  return files
