"""Config validation before anything is built or compiled: one error that lists every problem.

``validate_config(config)`` checks
  * unknown keys (typos) against the reference schema: the default ``configs/arith_tool.py``
    config plus ``EXTRA_KEYS`` (fields only some configs have),
  * types against the reference (an int is accepted for a float field),
  * impossible values (``eps_low >= 1``, ``K < 1``, a batch that does not split over the devices,
    a mesh larger than the machine, ...).
Each problem is reported as ``config.<field> = <value>: <what is wrong>; fix: <how>``.
"""

from __future__ import annotations

import importlib.util
import math
import os
from typing import Any, Callable, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# fields that only some configs define: name -> allowed types
EXTRA_KEYS: dict[str, tuple] = {
    "task.train_file": (str,),
    "task.switch_every": (int,),  # style_switch: policy steps per preferred-style phase
    "task.chain_lengths": (tuple,),  # chain_tool: calculator calls a problem needs
    "task.chain_weights": (tuple,),  # chain_tool: their probabilities
    "sft.reliable_calls": (int,),  # chain_tool: calls every demonstration makes
    "train.max_consecutive_nonfinite": (int,),
    "rollout.env_timeout_s": (int, float),
    "rollout.lockstep": (bool,),
    "checkpoint.max_to_keep": (int,),
    "checkpoint.resume": (bool,),
    "mesh": (dict,),
}
_DTYPES = ("float32", "bfloat16", "float16")
_TASKS = ("arith_tool", "chain_tool", "math", "style_switch")


class ConfigError(ValueError):
  """Raised by ``validate_config``; ``problems`` lists one line per bad field."""

  def __init__(self, problems: list[str]):
    self.problems = problems
    super().__init__("invalid config (nothing was built or compiled):\n  " + "\n  ".join(problems))


def _flatten(d, prefix="") -> dict[str, Any]:
  out = {}
  for k, v in d.items():
    key = f"{prefix}{k}"
    if hasattr(v, "items") and not (key in EXTRA_KEYS and dict in EXTRA_KEYS[key]):
      out.update(_flatten(v, key + "."))
    else:
      out[key] = dict(v.items()) if hasattr(v, "items") else v
  return out


def reference_schema() -> dict[str, tuple]:
  """Field name -> allowed types, from the default ``configs/arith_tool.py`` + ``EXTRA_KEYS``."""
  spec = importlib.util.spec_from_file_location("_sao_ref_config",
                                                os.path.join(ROOT, "configs", "arith_tool.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  schema = {}
  for k, v in _flatten(mod.get_config()).items():
    if isinstance(v, bool):
      schema[k] = (bool,)
    elif isinstance(v, float):
      schema[k] = (int, float)
    elif isinstance(v, int):
      schema[k] = (int,)
    else:
      schema[k] = (type(v),)
  schema["train.lam_policy"] = (str, int, float)
  schema.update(EXTRA_KEYS)
  return schema


def _rules(flat: dict, num_devices: int) -> list[tuple[str, Callable[[Any], bool], str, str]]:
  """(field, ok(value), what must hold, fix) for every value rule."""
  pos = lambda v: v > 0
  nonneg = lambda v: v >= 0
  unit = lambda v: 0.0 <= v <= 1.0
  r = [
      ("train.eps_low", lambda v: 0.0 <= v < 1.0, "must be in [0, 1) (the DIS band's lower edge "
       "is 1 - eps_low > 0)", "use e.g. 0.3 (the paper's value)"),
      ("train.eps_high", pos, "must be > 0", "use e.g. 5.0 (the paper's value)"),
      ("train.critic_updates_per_step", lambda v: v >= 1, "K must be >= 1",
       "use 2 (the paper's K)"),
      ("train.batch_size", lambda v: v >= 1, "must be >= 1", "use e.g. 32"),
      ("train.batch_size", lambda v: v % num_devices == 0,
       f"must be divisible by the number of devices ({num_devices})",
       f"use a multiple of {num_devices}"),
      ("train.num_steps", nonneg, "must be >= 0", "use e.g. 100"),
      ("train.policy_lr", pos, "must be > 0", "use e.g. 1e-6"),
      ("train.critic_lr", pos, "must be > 0", "use e.g. 5e-6"),
      ("train.critic_lr_warmup_steps", nonneg, "must be >= 0", "use 10"),
      ("train.critic_warmup_steps", nonneg, "must be >= 0", "use 0"),
      ("train.gamma", unit, "must be in [0, 1]", "use 1.0"),
      ("train.lam_alpha", pos, "must be > 0", "use 1.5"),
      ("train.max_grad_norm", pos, "must be > 0", "use 1.0"),
      ("train.lam_policy", lambda v: v == "adaptive" if isinstance(v, str) else 0.0 <= v <= 1.0,
       "must be 'adaptive' or a number in [0, 1]", "use 'adaptive'"),
      ("train.max_consecutive_nonfinite", lambda v: v >= 1, "must be >= 1", "use 3"),
      ("model.dtype", lambda v: v in _DTYPES, f"must be one of {_DTYPES}", "use 'float32'"),
      ("model.n_kv_heads", lambda v: v >= 1 and flat.get("model.n_heads", v) % v == 0,
       "must be >= 1 and divide model.n_heads", "use a divisor of model.n_heads"),
      ("rollout.temperature", pos, "must be > 0 (log-probs are recorded at this temperature)",
       "use 1.0"),
      ("rollout.max_prefill_length", lambda v: v <= flat.get("model.max_seq_len", v),
       "must be <= model.max_seq_len", "lower it or raise model.max_seq_len"),
      ("rollout.env_timeout_s", pos, "must be > 0", "use e.g. 30"),
      ("rollout.env_workers", lambda v: v >= -1,
       "must be >= -1 (-1 = auto, 0 = inline env.step, N = N env threads)", "use -1"),
      ("task.tool_latency_median_s", nonneg, "must be >= 0 seconds (0 = no tool latency)",
       "use 0 (off) or e.g. 0.2"),
      ("task.tool_latency_sigma", nonneg, "must be >= 0 (log-std of the lognormal latency)",
       "use e.g. 1.0"),
      ("task.tool_latency_median_s",
       lambda v: v == 0 or flat.get("task.name", "arith_tool") in ("arith_tool", "chain_tool"),
       "is only implemented for task.name='arith_tool' or 'chain_tool' (the calculator tool)",
       "set it to 0 or use task.name='arith_tool'"),
      ("task.tool_latency_median_s",
       lambda v: v * math.exp(4.0 * flat.get("task.tool_latency_sigma", 1.0))
       < flat.get("rollout.env_timeout_s", 30.0),
       "its tail (median * e^(4 sigma), the 99.997th percentile) must stay below "
       "rollout.env_timeout_s, or slow tool calls fail as timeouts",
       "raise rollout.env_timeout_s or lower task.tool_latency_median_s / tool_latency_sigma"),
      ("task.name", lambda v: v in _TASKS, f"must be one of {_TASKS}", "use 'arith_tool'"),
      ("task.max_turns", lambda v: v >= 1, "must be >= 1", "use 3"),
      ("sft.p_tool", unit, "must be in [0, 1]", "use 0.3"),
      ("sft.p_guess_correct", unit, "must be in [0, 1]", "use 0.1"),
      ("checkpoint.every_steps", nonneg, "must be >= 0 (0 = only at the end)", "use 50"),
      ("checkpoint.max_to_keep", lambda v: v >= 1, "must be >= 1", "use 2"),
      ("eval.every_steps", nonneg, "must be >= 0", "use 20"),
  ]
  for k in ("model.d_model", "model.n_layers", "model.n_heads", "model.head_dim", "model.d_ff",
            "model.max_seq_len", "rollout.slots", "rollout.max_new_tokens",
            "rollout.max_prefill_length", "rollout.queue_size", "eval.slots", "sft.batch_size",
            "task.n_train"):
    r.append((k, lambda v: v >= 1, "must be >= 1", "use a positive integer"))
  return r


def _mesh_problems(config, flat, num_devices: int) -> list[str]:
  """``mesh.shape`` ("data=1,fsdp=-1"; -1 = the remaining devices) against the machine."""
  from sao_jax.train.distributed import parse_mesh_shape  # pylint: disable=import-outside-toplevel
  text = (config.get("mesh") or {}).get("shape", "") or ""
  try:
    shape = parse_mesh_shape(text)
  except ValueError as e:
    return [f"config.mesh.shape = {text!r}: {e}"]
  if not shape:
    return []
  auto = [a for a, v in shape.items() if v == -1]
  bad = [a for a, v in shape.items() if v == 0 or v < -1]
  if bad or len(auto) > 1:
    return [f"config.mesh.shape = {text!r}: axis sizes must be >= 1, with at most one -1; "
            f"fix: e.g. 'fsdp=-1' or 'data=2,fsdp=4'"]
  fixed = math.prod(v for v in shape.values() if v > 0)
  if fixed > num_devices or (auto and num_devices % fixed) or (not auto and fixed > num_devices):
    return [f"config.mesh.shape = {text!r}: needs {fixed} devices (times the -1 axis) but this "
            f"machine has {num_devices}; fix: shrink the mesh axes so their product divides "
            f"{num_devices}"]
  sizes = {a: (num_devices // fixed if v == -1 else v) for a, v in shape.items()}
  data = sizes.get("data", 1) * sizes.get("fsdp", 1)
  if "train.batch_size" in flat and flat["train.batch_size"] % data:
    return [f"config.train.batch_size = {flat['train.batch_size']}: must be divisible by the "
            f"mesh's data x fsdp size ({data}); fix: use a multiple of {data}"]
  return []


def validate_config(config, num_devices: Optional[int] = None) -> None:
  """Raises ``ConfigError`` listing every unknown key, wrong type and impossible value.

  ``num_devices`` defaults to ``jax.device_count()``; jax is imported but nothing is compiled.
  A ``config.mesh`` dict of axis sizes (e.g. ``{"data": 4, "fsdp": 2}``) must fit the devices
  and ``train.batch_size`` must split over its data axes."""
  if num_devices is None:
    import jax  # pylint: disable=import-outside-toplevel
    num_devices = jax.device_count()
  schema = reference_schema()
  flat = _flatten(config)
  problems, bad_type = [], set()
  for k, v in flat.items():
    if k not in schema:
      bad_type.add(k)
      close = [s for s in schema if s.split(".")[-1] == k.split(".")[-1] or
               (s.split(".")[0] == k.split(".")[0] and _similar(s.split(".")[-1], k.split(".")[-1]))]
      problems.append(f"config.{k}: unknown key; fix: remove it"
                      + (f" or use {', '.join('config.' + c for c in close[:3])}" if close else ""))
      continue
    types = schema[k]
    if bool in types and not isinstance(v, bool) or bool not in types and isinstance(v, bool) \
        or not isinstance(v, types):
      bad_type.add(k)
      problems.append(f"config.{k} = {v!r}: wrong type {type(v).__name__}; fix: give a "
                      f"{' or '.join(t.__name__ for t in types)}")
      continue
    if isinstance(v, float) and not math.isfinite(v):
      problems.append(f"config.{k} = {v!r}: must be finite; fix: give a finite number")
  for field, ok, what, fix in _rules(flat, num_devices):
    if field in flat and field not in bad_type:
      try:
        good = ok(flat[field])
      except TypeError:
        good = False
      if not good:
        problems.append(f"config.{field} = {flat[field]!r}: {what}; fix: {fix}")
  problems.extend(_mesh_problems(config, flat, num_devices))
  model = config.get("model", {})
  if (not model.get("checkpoint_dir") and not model.get("gguf", "")
      and not config.get("allow_random_init", False)):
    problems.append("config.model.checkpoint_dir = '': this config starts RL from a trained "
                    "policy; fix: set --config.model.checkpoint_dir=<sao_jax checkpoint folder> "
                    "(or use the ':smoke' variant for a tiny random model)")
  if problems:
    raise ConfigError(problems)


def _similar(a: str, b: str) -> bool:
  import difflib  # pylint: disable=import-outside-toplevel
  return difflib.SequenceMatcher(None, a, b).ratio() >= 0.75
