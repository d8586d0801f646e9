"""Config validation before anything is built or compiled: one error that lists every problem.

``validate_config(config)`` checks, in one pass over every field,
  * what each field's declaration in ``sao_jax/roles.py`` carries (``roles.field_problems``):
    unknown keys (typos), types (an int is accepted for a float field), enum values (a field's
    ``choices``, e.g. the keys of ``algo.OBJECTIVES``), ranges (a field's ``check``),
  * single-field rules a range cannot say (``head_dim`` even, ``lam_policy``, regexes, ...),
  * ``run_dir``: a folder (or one that can be created) this user can write to;
    ``model.checkpoint_dir``: a Hugging Face folder or a run's ``checkpoints/`` folder,
  * cross-field rules (a grpo mode needs ``group_size >= 2`` dividing ``batch_size``, a grpo
    estimator needs a grpo mode, ``aggregation='sum_norm'`` needs ``loss_norm_constant > 0``,
    a staleness policy needs ``max_staleness >= 0``, a batch that splits over the devices, a mesh
    no larger than the machine, ...).
Each problem is reported as ``config.<field> = <value>: <what is wrong>; fix: <how>``.

The consumers (``train/modes.py:resolve``, ``rollout/staleness.py:check_policy``,
``LearnerConfig``, the objectives, ...) keep their own checks; this pass runs first, in
``sao_jax/main.py`` right after the flags are parsed, so that a bad value costs seconds, not a
supervised warm-up.
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
from typing import Optional

from sao_jax import algo, roles
from sao_jax.roles import ConfigError  # pylint: disable=unused-import  # re-exported
from sao_jax.train.distributed import parse_mesh_shape

_PPO_FAMILY = ("ppo_clip", "tis", "icepop")  # objectives that read ppo_eps_* and dual_clip


def estimator_names() -> tuple[str, ...]:
  """Names of the advantage estimators (``train.advantage_estimator`` without "auto"): the keys
  of ``sao_jax.algo.ESTIMATORS``."""
  return tuple(algo.ESTIMATORS)


def enum_choices() -> dict[str, tuple]:
  """Enum field -> its allowed values: the ``choices`` of ``sao_jax/roles.py``'s fields (a
  registry's keys are read now)."""
  return {name: spec.allowed() for name, spec in roles.fields().items()
          if spec.choices is not None}


Rule = tuple  # (field, ok(value) -> bool, what must hold, fix, other fields ok() reads)


def _resolved(flat: dict) -> tuple[str, str, str]:
  """(mode, objective, estimator) after "auto" (``train/modes.py`` defaults)."""
  mode = flat.get("train.mode", "sao")
  grouped = str(mode).startswith("grpo")
  objective = flat.get("train.objective", "auto")
  if objective == "auto":
    objective = "dis" if mode == "sao" else "ppo_clip"
  estimator = flat.get("train.advantage_estimator", "auto")
  if estimator == "auto":
    estimator = "grpo" if grouped else "skip_obs_gae"
  return mode, objective, estimator


def _regexes_ok(patterns) -> bool:
  for p in patterns:
    re.compile(p)  # re.error is caught by the caller
  return True


def _lam_policy_ok(v) -> bool:
  """'adaptive', or a number in [0, 1]; the field's default is a string, so ml_collections keeps
  ``--config.train.lam_policy=0.95`` as the string '0.95' (``steps.targets_from_values`` reads it
  with ``jnp.float32``)."""
  if v == "adaptive":
    return True
  try:
    lam = float(v)
  except ValueError:
    return False
  return 0.0 <= lam <= 1.0


def _rules(flat: dict, num_devices: Optional[int]) -> list[Rule]:
  """(field, ok(value), what must hold, fix, reads) for every value and cross-field rule.

  ``reads`` names the other fields ``ok`` looks at: the rule is skipped when one of them has a
  wrong type (that problem is reported on its own). ``num_devices`` None skips the rules that
  need the device count."""
  mode, objective, estimator = _resolved(flat)
  grouped = str(mode).startswith("grpo")
  r = [
      ("train.dual_clip", lambda v: v == 0 or v > 1, "must be 0 (off) or > 1 (the dual-clip "
       "constant c bounds -c * A for A < 0)", "use 0 or e.g. 3.0"),
      ("train.icepop_high", lambda v: v > 1 and v > flat.get("train.icepop_low", 0.0),
       "must be > 1 and > train.icepop_low", "use 5.0", ("train.icepop_low",)),
      ("train.aggregation",
       lambda v: v != "sum_norm" or flat.get("train.loss_norm_constant", 0) > 0,
       "needs train.loss_norm_constant > 0 (the Dr. GRPO divisor)",
       "set --config.train.loss_norm_constant=<max response tokens, e.g. 48> or use "
       "aggregation='token_mean'", ("train.loss_norm_constant",)),
      ("train.policy_minibatches",
       lambda v: v < 1 or flat.get("train.batch_size", 1) % v == 0,
       f"must divide train.batch_size ({flat.get('train.batch_size')}; mini-batches of equal "
       "size)", "use a divisor of train.batch_size, e.g. 4 for 32", ("train.batch_size",)),
      ("train.value_bounds",
       lambda v: len(v) == 0 or (len(v) == 2 and float(v[0]) < float(v[1])),
       "must be () (off) or (lo, hi) with lo < hi", "use () or the reward range, e.g. (0.0, 1.0)"),
      ("train.lam_policy", _lam_policy_ok, "must be 'adaptive' or a number in [0, 1] (the CLI "
       "gives a number as a string, e.g. '0.95', which is fine)", "use 'adaptive'"),
      ("train.critic_frozen_patterns", _regexes_ok, "must be a tuple of valid regular "
       "expressions (re.compile failed)", "fix the pattern, e.g. r'/attn/'"),
      ("model.n_kv_heads", lambda v: v >= 1 and flat.get("model.n_heads", v) % v == 0,
       "must be >= 1 and divide model.n_heads", "use a divisor of model.n_heads",
       ("model.n_heads",)),
      ("model.head_dim", lambda v: v % 2 == 0, "must be even (RoPE rotates pairs)",
       "use e.g. 32"),
      ("rollout.max_prefill_length", lambda v: v <= flat.get("model.max_seq_len", v),
       "must be <= model.max_seq_len", "lower it or raise model.max_seq_len",
       ("model.max_seq_len",)),
      ("task.obs_pad", lambda v: v <= 0 or v + 32 <= flat.get("rollout.max_prefill_length", 64),
       f"each padded observation (obs_pad + up to 32 tokens: tags and the result) must fit one "
       f"prefill chunk of rollout.max_prefill_length "
       f"({flat.get('rollout.max_prefill_length')}), or every episode ends at its first tool "
       "output as truncated, with reward 0",
       "raise rollout.max_prefill_length to >= task.obs_pad + 32 (e.g. 160 for 100)",
       ("rollout.max_prefill_length",)),
      ("rollout.lockstep", lambda v: not v or flat.get("rollout.backend", "thread") == "thread",
       "needs rollout.backend='thread' (a deterministic in-process rollout)",
       "set rollout.lockstep=False or rollout.backend='thread'", ("rollout.backend",)),
      ("task.tool_wall_s", lambda v: flat.get("task.name") != "tir_math"
       or v + 5 <= flat.get("rollout.env_timeout_s", 30.0),
       "must be > 0 and at least 5 s below rollout.env_timeout_s (sandbox start-up and teardown "
       "included), or a slow program fails the trajectory as an env timeout",
       "lower task.tool_wall_s or raise rollout.env_timeout_s", ("rollout.env_timeout_s",)),
      ("task.tool_latency_median_s",
       lambda v: v == 0 or flat.get("task.name", "arith_tool") in ("arith_tool", "chain_tool"),
       "is only implemented for task.name='arith_tool' or 'chain_tool' (the calculator tool)",
       "set it to 0 or use task.name='arith_tool'", ("task.name",)),
      ("task.tool_latency_median_s",
       lambda v: v * math.exp(4.0 * flat.get("task.tool_latency_sigma", 1.0))
       < flat.get("rollout.env_timeout_s", 30.0),
       "its tail (median * e^(4 sigma), the 99.997th percentile) must stay below "
       "rollout.env_timeout_s, or slow tool calls fail as timeouts",
       "raise rollout.env_timeout_s or lower task.tool_latency_median_s / tool_latency_sigma",
       ("task.tool_latency_sigma", "rollout.env_timeout_s")),
      ("task.train_file", lambda v: bool(v) or flat.get("task.name") != "math",
       "task.name='math' reads its prompts from this JSONL file",
       "set it to a packaged name (e.g. 'aime25.jsonl') or a path", ("task.name",)),
      ("distributed.num_processes", lambda v: v == -1 or v >= 1,
       "must be -1 (from the environment) or >= 1", "use -1"),
      ("distributed.process_id", lambda v: v == -1 or 0 <= v < max(
          flat.get("distributed.num_processes", -1), 0) or
       (v >= 0 and flat.get("distributed.num_processes", -1) == -1),
       "must be -1 (from the environment) or in [0, distributed.num_processes)", "use -1",
       ("distributed.num_processes",)),
      # cross-field rules of the training mode (train/modes.py:resolve)
      ("train.group_size", lambda v: not grouped or v >= 2,
       f"must be >= 2 in train.mode={mode!r} (G rollouts per prompt)", "use e.g. 8",
       ("train.mode",)),
      ("train.batch_size", lambda v: not grouped or flat.get("train.group_size", 1) < 1
       or v % flat.get("train.group_size", 1) == 0,
       f"must be a multiple of train.group_size ({flat.get('train.group_size')}) in "
       f"train.mode={mode!r} (whole groups per step)",
       "use a multiple of train.group_size", ("train.mode", "train.group_size")),
      ("train.advantage_estimator", lambda v: grouped or not str(estimator).startswith("grpo"),
       f"the grpo estimators normalise over groups, which train.mode={mode!r} does not make",
       "use train.mode='grpo_async' or 'grpo_sync', or a critic / running-mean estimator",
       ("train.mode",)),
      ("train.dual_clip", lambda v: v == 0 or objective in _PPO_FAMILY,
       f"is read only by the PPO-family objectives {_PPO_FAMILY}; train.objective resolves "
       f"to {objective!r} here", "set train.dual_clip=0 or train.objective='ppo_clip'",
       ("train.mode", "train.objective")),
      ("rollout.lockstep_delay", lambda v: v == 0 or flat.get("rollout.lockstep", False),
       "a fixed rollout delay needs the lockstep rollout",
       "set --config.rollout.lockstep=True or rollout.lockstep_delay=0", ("rollout.lockstep",)),
      ("rollout.staleness_policy",
       lambda v: v == "none" or flat.get("rollout.max_staleness", -1) >= 0,
       f"needs rollout.max_staleness >= 0 (got {flat.get('rollout.max_staleness')!r})",
       "set --config.rollout.max_staleness=<eta, e.g. 4> or staleness_policy='none'",
       ("rollout.max_staleness",)),
      ("rollout.num_workers", lambda v: v == 1 or flat.get("rollout.backend", "thread") == "ray",
       "more than one rollout worker needs rollout.backend='ray' (the thread backend runs one)",
       "set rollout.num_workers=1 or rollout.backend='ray'", ("rollout.backend",)),
      ("rollout.devices", lambda v: v == 0 or flat.get("rollout.backend", "thread") == "thread",
       "places the in-process engine (backend 'thread'); a Ray actor gets its devices from "
       "rollout.ray_num_gpus / rollout.ray_resources", "set rollout.devices=0 with "
       "rollout.backend='ray', or rollout.backend='thread'", ("rollout.backend",)),
      ("rollout.ray_address", lambda v: not v or flat.get("rollout.backend", "thread") == "ray",
       "is read only by rollout.backend='ray'", "set rollout.backend='ray' or leave it ''",
       ("rollout.backend",)),
      ("log.wandb_project", lambda v: not v or importlib.util.find_spec("wandb") is not None,
       "logging to Weights & Biases needs the wandb package, which is not installed",
       "`pip install wandb` (and `wandb login`), or leave log.wandb_project empty"),
  ]
  if num_devices is not None:
    r.append(("train.batch_size", lambda v: v % num_devices == 0,
              f"must be divisible by the number of devices ({num_devices})",
              f"use a multiple of {num_devices}"))
  return r


def _mesh_problems(config, flat, num_devices: int) -> list[str]:
  """``mesh.shape`` ("data=1,fsdp=-1"; -1 = the remaining devices) against the machine."""
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
    return [f"config.mesh.shape = {text!r}: needs {fixed} devices (times the -1 axis) but the "
            f"learner has {num_devices} (this machine's, less rollout.devices); fix: shrink the "
            f"mesh axes so their product divides {num_devices}"]
  sizes = {a: (num_devices // fixed if v == -1 else v) for a, v in shape.items()}
  data = sizes.get("data", 1) * sizes.get("fsdp", 1)
  if "train.batch_size" in flat and flat["train.batch_size"] % data:
    return [f"config.train.batch_size = {flat['train.batch_size']}: must be divisible by the "
            f"mesh's data x fsdp size ({data}); fix: use a multiple of {data}"]
  return []


def _placement_problems(flat: dict, num_devices: int) -> tuple[list[str], int]:
  """(problems, the learner's device count): ``rollout.devices`` leaves the learner at least one
  of ``num_devices``; ``rollout.mesh`` lays out the rollout's devices (one, device 0, when
  ``rollout.devices`` is 0) and its ``data`` axis divides ``rollout.slots`` and ``eval.slots``."""
  from sao_jax.rollout import placement  # pylint: disable=import-outside-toplevel
  n = flat.get("rollout.devices", 0)
  if not isinstance(n, int) or n < 0:
    return [], num_devices
  if n >= num_devices:
    return [f"config.rollout.devices = {n}: this machine has {num_devices} device(s) and the "
            f"learner needs at least one; fix: use at most {num_devices - 1}, or 0 to share "
            "device 0 with the learner"], num_devices
  text = flat.get("rollout.mesh", "")
  try:
    shape = placement.rollout_shape(text, max(n, 1))
  except ValueError as e:
    return [f"config.rollout.mesh = {text!r}: {str(e).split(': ', 1)[-1]}"], num_devices - n
  problems = []
  kv = flat.get("model.n_kv_heads")
  random_init = not flat.get("model.checkpoint_dir") and not flat.get("model.gguf")
  if n and random_init and isinstance(kv, int) and kv % shape["tensor"]:
    # (a checkpoint's head counts are read later: the engine checks those when it is built)
    problems.append(f"config.rollout.mesh = {text!r}: its tensor axis ({shape['tensor']}) must "
                    f"divide model.n_kv_heads ({kv}; the KV cache is split by KV heads); fix: a "
                    f"tensor size that divides {kv}, the rest on data")
  for field in ("rollout.slots", "eval.slots"):
    v = flat.get(field)
    if isinstance(v, int) and v % shape["data"]:
      problems.append(f"config.{field} = {v}: must be a multiple of rollout.mesh's data axis "
                      f"({shape['data']} devices each hold as many slots); fix: use a multiple "
                      f"of {shape['data']}, or a smaller data axis in rollout.mesh")
  return problems, num_devices - n


def run_dir_problems(run_dir: str) -> list[str]:
  """``run_dir`` must be a folder this user can create files in, or one it can create: not
  empty, not an existing file (nor below one), and its nearest existing folder writable. Reads
  the file system only (nothing is created)."""
  fix = "give a folder path, e.g. --config.run_dir=runs/my_run (created if missing)"
  if not run_dir:
    return [f"config.run_dir = '': empty; fix: {fix}"]
  path = os.path.abspath(os.path.expanduser(run_dir))
  existing = path
  while not os.path.exists(existing):
    existing = os.path.dirname(existing)
  if not os.path.isdir(existing):
    where = ("is an existing file, not a folder" if existing == path
             else f"is below the file {existing}")
    return [f"config.run_dir = {run_dir!r}: {where}; fix: {fix}"]
  if not os.access(existing, os.W_OK | os.X_OK):
    what = "this folder" if existing == path else f"its parent {existing}"
    return [f"config.run_dir = {run_dir!r}: {what} is not writable by this user (results, "
            "checkpoints and logs go there); fix: use a folder you can write to, e.g. "
            "--config.run_dir=$HOME/sao_runs/my_run, or change the folder's permissions"]
  return []


def checkpoint_dir_problems(checkpoint_dir: str) -> list[str]:
  """``model.checkpoint_dir`` ("" = none) must be a Hugging Face folder (``config.json``), a hub
  id in the hub cache or downloadable (``sao_jax.hub``), or a
  sao_jax checkpoints folder holding at least one complete step (a folder named by its step;
  orbax's half-written ones carry a suffix). A run folder is refused pointing at its
  ``checkpoints/`` subfolder. Reads the file system (and the hub cache or hub for a hub id)."""
  if not checkpoint_dir:
    return []
  from sao_jax import hub  # pylint: disable=import-outside-toplevel
  from sao_jax.pretrained import is_run_folder  # pylint: disable=import-outside-toplevel
  if hub.is_hub_id(checkpoint_dir):  # a Hugging Face hub id: in the cache, or downloadable
    try:
      hub.resolve_checkpoint_dir(checkpoint_dir)
    except FileNotFoundError as e:
      return [str(e)]
    return []
  d = checkpoint_dir
  fix = ("give a Hugging Face folder (config.json + *.safetensors + tokenizer.json) or hub id "
         "(Qwen/Qwen3-0.6B), or a sao_jax "
         "run's checkpoints folder, e.g. --config.model.checkpoint_dir=runs/arith_tool/checkpoints")
  if not os.path.exists(d):
    return [f"config.model.checkpoint_dir = {d!r}: does not exist; fix: {fix}"]
  if not os.path.isdir(d):
    return [f"config.model.checkpoint_dir = {d!r}: is a file, not a folder; fix: {fix}"]
  inner = os.path.join(d, "checkpoints")
  if is_run_folder(d):
    if os.path.isdir(inner):
      return [f"config.model.checkpoint_dir = {d!r}: is a run folder; its checkpoints are in "
              f"{inner}; fix: --config.model.checkpoint_dir={inner}"]
    return [f"config.model.checkpoint_dir = {d!r}: is a run folder without checkpoints (its run "
            "had checkpoint.every_steps=0 and saved none); fix: train with checkpoints, or "
            f"{fix[0].lower() + fix[1:]}"]
  if os.path.isfile(os.path.join(d, "config.json")):
    return []  # a Hugging Face folder: its loader checks the rest
  if not any(n.isdigit() and os.path.isdir(os.path.join(d, n)) for n in os.listdir(d)):
    return [f"config.model.checkpoint_dir = {d!r}: holds no complete checkpoint (no step folder "
            f"such as {os.path.join(d, '100')}, no config.json); fix: {fix}"]
  return []


def _coordinated(config) -> bool:
  """True when ``jax.distributed`` will be started (then no JAX call may come before it)."""
  address = (config.get("distributed") or {}).get("coordinator_address", "")
  return bool(address or os.environ.get("JAX_COORDINATOR_ADDRESS"))


def validate_config(config, num_devices: Optional[int] = None) -> None:
  """Raises ``ConfigError`` listing every unknown key, wrong type, bad enum value, out-of-range
  number and broken cross-field rule, before anything is built or compiled.

  ``num_devices`` defaults to ``jax.device_count()`` (jax is imported, nothing is compiled);
  in a multi-process job (``distributed.coordinator_address`` or ``JAX_COORDINATOR_ADDRESS``
  set) it stays None, so no JAX backend starts before ``jax.distributed.initialize``, and the
  device-count rules (batch and mesh over the devices) are left to the trainer.
  ``mesh.shape`` (e.g. "data=2,fsdp=-1") must fit the learner's devices (those
  ``rollout.devices`` leaves), ``train.batch_size`` must split over its data x fsdp axes, and
  ``rollout.mesh`` must lay out the rollout's devices."""
  if num_devices is None and not _coordinated(config):
    import jax  # pylint: disable=import-outside-toplevel  # only here: the count starts a backend
    num_devices = jax.device_count()
  given = roles.flatten(config)
  problems, bad = roles.field_problems(given)
  flat = {name: spec.default for name, spec in roles.fields().items()}
  flat.update(given)  # the rules see every field (a missing one has its default)
  if flat["rollout.devices"] and _coordinated(config) and "rollout.devices" not in bad:
    problems.append(f"config.rollout.devices = {flat['rollout.devices']}: splits one process's "
                    "devices; a multi-process job's rollout runs on Ray actors; fix: set "
                    "rollout.devices=0")
  if num_devices is not None and not bad & {"rollout.devices", "rollout.mesh", "rollout.slots",
                                            "eval.slots"}:
    placed, num_devices = _placement_problems(flat, num_devices)  # the learner's devices
    problems.extend(placed)
  for rule in _rules(flat, num_devices):
    field, ok, what, fix = rule[:4]
    reads = rule[4] if len(rule) > 4 else ()
    if field not in flat or field in bad or any(f in bad for f in reads):
      continue
    try:
      good = ok(flat[field])
    except (TypeError, re.error):
      good = False
    if not good:
      problems.append(f"config.{field} = {flat[field]!r}: {what}; fix: {fix}")
  if num_devices is not None:
    problems.extend(_mesh_problems(config, flat, num_devices))
  if isinstance(flat.get("run_dir"), str) and "run_dir" not in bad:
    problems.extend(run_dir_problems(flat["run_dir"]))
  if isinstance(flat.get("model.checkpoint_dir"), str) and "model.checkpoint_dir" not in bad:
    problems.extend(checkpoint_dir_problems(flat["model.checkpoint_dir"]))
  model = config.get("model", {})
  if (not model.get("checkpoint_dir") and not model.get("gguf", "")
      and not config.get("allow_random_init", False)):
    problems.append("config.model.checkpoint_dir = '': this config starts RL from a trained "
                    "policy; fix: set --config.model.checkpoint_dir=<sao_jax checkpoint folder> "
                    "(or use the ':smoke' variant for a tiny random model)")
  if problems:
    raise ConfigError(problems)


def _rollout_expert_axis(flat: dict) -> int:
  """The size of ``rollout.mesh``'s expert axis over ``rollout.devices`` (1 when invalid)."""
  from sao_jax.rollout import placement  # pylint: disable=import-outside-toplevel
  try:
    return placement.rollout_shape(flat.get("rollout.mesh", ""), flat["rollout.devices"])["expert"]
  except (ValueError, KeyError, TypeError):
    return 1


def config_warnings(config) -> list[str]:
  """Lines to print at the start of a run for valid but probably unintended settings (the
  driver prints each once, on process 0):
    * a PPO-family objective (ppo_clip, tis, icepop) with ``train.policy_minibatches=1``: one
      update per batch, so its ratio pi / pi_old is 1 at that update and the PPO clip never
      acts (README, "paper name" table);
    * ``rollout.devices`` > 0 with an empty ``mesh.shape``: the learner uses one device;
    * an ``expert`` axis in ``rollout.mesh`` for a dense random-init model: copies."""
  flat = roles.flatten(config)
  _, objective, _ = _resolved(flat)
  out = []
  if flat.get("rollout.devices", 0) and not flat.get("mesh.shape"):
    out.append(f"warning: rollout.devices={flat['rollout.devices']} with mesh.shape='': the "
               "learner uses one device (the first after the rollout's) and any other devices "
               "stay idle; to train on all of them use e.g. --config.mesh.shape=fsdp=-1.")
  dense_random = not (flat.get("model.n_experts") or flat.get("model.checkpoint_dir")
                      or flat.get("model.gguf"))
  if dense_random and flat.get("rollout.devices", 0) and _rollout_expert_axis(flat) > 1:
    out.append(f"warning: rollout.mesh={flat['rollout.mesh']!r} has an expert axis but "
               "model.n_experts=0 (a dense model): that axis holds copies of the weights; "
               "put those devices on data instead.")
  if objective in _PPO_FAMILY and flat.get("train.policy_minibatches", 1) == 1:
    out.append(f"warning: train.objective resolves to {objective!r} with "
               "train.policy_minibatches=1: one update per batch, so the PPO ratio pi / pi_old "
               "is 1 and the clip never acts; for PPO-style clipping use e.g. "
               "--config.train.policy_minibatches=4 (SAO's DIS needs no mini-batches).")
  return out
