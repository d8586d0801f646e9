"""What a config needs on a TPU slice, computed on this host without one.

``python -m sao_jax.plan --config=configs/aime.py --topology=v5p-64 --model=qwen3-30b-a3b``

compiles, ahead of time and for the named slice, the programs a run executes -- the learner's
jitted steps (targets, critic update, policy update: ``Learner.jitted_steps``, the very
functions training runs) on the config's mesh and batch shapes, and the rollout engine's prefill
and one decode step (``SAOEngine``) -- with abstract parameters
(``jax.ShapeDtypeStruct``: no weights, no accelerator). XLA's TPU compiler (``libtpu``) gives
each program's per-chip memory (``memory_analysis``). Printed: one row per program with its
per-chip GB against the chip's HBM and whether it fits, the FLOPs of one policy step and the step
time they imply at ``--mfu`` of the chip's peak bf16 FLOP/s. Exit status 0 when everything
fits, 1 when a program does not (the message names the config fields to change), 2 when
``libtpu`` is missing or the arguments are wrong. ``docs/scale.md`` explains the numbers and
holds the table for the paper's models.

How the numbers are formed (per chip):

* total = argument + output - alias + temp + other. ``alias`` is the output memory that reuses
  a donated argument (the train states); ``other`` is what the learner keeps on the chips while
  the program runs without passing it in (the other model's train state, the batch, the
  targets). Where the engine runs is the main job's split (``build.make_meshes``):
  ``rollout.devices`` N > 0 gives it the slice's first N chips laid out as ``rollout.mesh``
  (weights and KV cache split over ``tensor`` / ``expert``, slots over ``data``:
  ``SAOEngine.param_shardings`` / ``state_shardings``) and the learner the other chips as
  ``mesh.shape``; N = 0 plans it alone on one chip (params replicated, every slot's KV cache)
  and the learner on every chip. The learner's FLOPs are divided by the learner's chips.
* A program XLA refuses at the chip's HBM (RESOURCE_EXHAUSTED, after it tried to fit it) does
  not fit; its temporaries come from XLA's message, its argument and output bytes from the
  abstract shapes. A compiler crash (libtpu segfaults on some programs) loses that program
  only: the compiles run in a child process, restarted after a crash.
* FLOPs are model FLOPs: XLA's cost analysis of the learner's steps as traced on one CPU device
  (seconds, nothing compiled) on the whole batch at full depth, divided by the learner's chips. The
  compiled TPU programs' own counts are not used: XLA counts a loop body once (the micro-batch
  ``lax.scan``, and loops the TPU compiler makes of collective matmuls), and partitioned
  programs repeat work on several chips.
* Depth: layers are Python-unrolled, so a 48-layer compile takes long. By default the programs
  are compiled at 1 and 2 layers (``--depths``) and every byte count is extrapolated linearly
  to the model's depth (``q(L) = q(1) + (q(2) - q(1)) (L - 1)``: exact for parameters and
  optimizer state, an estimate for XLA's temporaries); the table says so. ``--depths=full``
  compiles the whole model (the default for a model whose ``ModelConfig.scan_layers`` is set:
  a scanned stack compiles in time flat in depth); ``--layers=N`` plans an N-layer model.
"""

from __future__ import annotations

import os

# libtpu reads these when it loads (at the first topology query, not at ``import jax``). On a
# host without TPUs it otherwise prints warnings that it could not find the accelerator type and
# worker hostnames, and it refuses a second process while one holds /tmp/libtpu_lockfile.
# Compiling needs neither: set them unless the user did (a TPU VM sets its own). JAX itself runs
# on the host CPU: the slice's devices are only described, never started.
for _k, _v in (("TPU_ACCELERATOR_TYPE", "v5litepod-8"), ("TPU_WORKER_HOSTNAMES", "localhost"),
               ("TPU_SKIP_MDS_QUERY", "1"), ("ALLOW_MULTIPLE_LIBTPU_LOAD", "1"),
               ("TF_CPP_MIN_LOG_LEVEL", "2"), ("JAX_PLATFORMS", "cpu")):
  os.environ.setdefault(_k, _v)

import dataclasses  # pylint: disable=wrong-import-position
import importlib.util  # pylint: disable=wrong-import-position
import json  # pylint: disable=wrong-import-position
import math  # pylint: disable=wrong-import-position
import re  # pylint: disable=wrong-import-position
import signal  # pylint: disable=wrong-import-position
import subprocess  # pylint: disable=wrong-import-position
import sys  # pylint: disable=wrong-import-position
import time  # pylint: disable=wrong-import-position
from typing import Any, Optional, Sequence  # pylint: disable=wrong-import-position

GIB = 1 << 30

INSTALL_HINT = ('libtpu is not installed, and XLA needs it to compile for TPU on this host. '
                'Install the optional extra: pip install -e ".[tpu]" (or: pip install '
                '"libtpu==0.0.42.*", the version jax 0.10.2 pins).')


@dataclasses.dataclass(frozen=True)
class Chip:
  """A TPU generation: HBM per chip (bytes), peak dense bf16 FLOP/s per chip, the name
  ``get_topology_desc`` takes, and how many TensorCores an accelerator-type name counts per chip
  (v5p names count TensorCores: v5p-8 is 4 chips)."""
  name: str
  hbm_bytes: int
  peak_flops: float
  topology_prefix: str
  cores_per_chip: int
  dims: int  # torus dimensions of the topology name (2: "2x4", 3: "2x2x1")


CHIPS = {
    "v5e": Chip("v5e", 16 * GIB, 197e12, "v5e", 1, 2),
    "v5p": Chip("v5p", 95 * GIB, 459e12, "v5p", 2, 3),
    "v6e": Chip("v6e", 32 * GIB, 918e12, "v6e", 1, 2),
}
ALIASES = {"v5litepod": "v5e", "v5e": "v5e", "v5lite": "v5e", "v5p": "v5p", "v6e": "v6e"}
# chips -> the slice's chip grid (Cloud TPU's published shapes)
GRID_2D = {1: (1, 1), 4: (2, 2), 8: (2, 4), 16: (4, 4), 32: (4, 8), 64: (8, 8), 128: (8, 16),
           256: (16, 16)}
GRID_3D = {4: (2, 2, 1), 8: (2, 2, 2), 16: (2, 2, 4), 32: (2, 4, 4), 64: (4, 4, 4),
           128: (4, 4, 8), 256: (4, 8, 8), 512: (8, 8, 8), 1024: (8, 8, 16), 2048: (8, 16, 16),
           4096: (16, 16, 16)}


@dataclasses.dataclass(frozen=True)
class Slice:
  """A TPU slice: ``name`` as given, ``chip``, ``topology`` (``get_topology_desc`` name) and
  ``chips``."""
  name: str
  chip: Chip
  topology: str
  chips: int


def parse_slice(name: str) -> Slice:
  """An accelerator type as users know it (``v5litepod-8``, ``v5e-16``, ``v5p-8`` -- TensorCores,
  so 4 chips --, ``v5p-64``, ``v6e-8``) or a topology name (``v5e:2x4``, ``v5p:2x2x1``) ->
  ``Slice``. Raises ValueError naming ``--topology`` and the accepted forms."""
  text = name.strip().lower()
  m = re.fullmatch(r"([a-z0-9]+):(\d+(?:x\d+)+)", text)
  if m:
    gen = ALIASES.get(m.group(1))
    grid = tuple(int(v) for v in m.group(2).split("x"))
    if gen is None or len(grid) != CHIPS[gen].dims:
      raise ValueError(f"--topology={name!r}: a topology name is v5e:AxB, v6e:AxB or "
                       "v5p:AxBxC.")
    chip = CHIPS[gen]
    return Slice(name, chip, f"{chip.topology_prefix}:{m.group(2)}", math.prod(grid))
  m = re.fullmatch(r"([a-z0-9]+)-(\d+)", text)
  gen = ALIASES.get(m.group(1)) if m else None
  if gen is None:
    raise ValueError(f"--topology={name!r}: give an accelerator type (v5litepod-8, v5p-8, "
                     f"v5p-64, v6e-8, ...) or a topology name (v5e:2x4, v5p:2x2x1).")
  chip, count = CHIPS[gen], int(m.group(2))
  if count % chip.cores_per_chip:
    raise ValueError(f"--topology={name!r}: {gen} accelerator types count TensorCores, "
                     f"{chip.cores_per_chip} per chip; give an even count (v5p-8 = 4 chips).")
  chips = count // chip.cores_per_chip
  grids = GRID_3D if chip.dims == 3 else GRID_2D
  if chips not in grids:
    raise ValueError(f"--topology={name!r}: no {gen} slice of {chips} chips; known: "
                     + ", ".join(f"{m.group(1)}-{n * chip.cores_per_chip}" for n in grids) + ".")
  return Slice(name, chip, f"{chip.topology_prefix}:{'x'.join(map(str, grids[chips]))}", chips)


def libtpu_available() -> bool:
  """True when the ``libtpu`` package is importable (what XLA's TPU compiler needs)."""
  try:
    return importlib.util.find_spec("libtpu") is not None
  except (ImportError, ValueError):  # ValueError: sys.modules["libtpu"] is None
    return False


def slice_devices(sl: Slice) -> list:
  """The slice's TPU devices, described on this host (``jax.experimental.topologies``)."""
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel
  kwargs = {"chips_per_host_bounds": (1, 1, 1)} if sl.chips == 1 else {}
  return list(topologies.get_topology_desc(topology_name=sl.topology, platform="tpu",
                                            **kwargs).devices)


def _run(config):
  """The typed ``roles.Run`` of the plan's ConfigDict (this CLI is a top: it converts)."""
  from sao_jax import roles  # pylint: disable=import-outside-toplevel
  return config if isinstance(config, roles.Run) else roles.from_config(config)


# ---- model shapes --------------------------------------------------------------------------------
def model_config(config, model: str = "", layers: int = 0):
  """The policy's ``ModelConfig``: the preset ``model`` (``sao_jax.models.presets``), else the
  Hugging Face ``config.json`` in ``model.checkpoint_dir``, else ``config.model`` (a random
  init; vocabulary of the task's tokenizer); lengths and dtypes from ``config.model`` as
  ``pretrained.load_model`` sets them, and so are ``remat`` and ``scan_layers`` (how the
  training forward runs). ``layers`` > 0 keeps only the first ``layers`` blocks."""
  from sao_jax import pretrained  # pylint: disable=import-outside-toplevel
  from sao_jax.models import hf, presets  # pylint: disable=import-outside-toplevel
  from sao_jax.data.tokenizer import CharTokenizer  # pylint: disable=import-outside-toplevel
  m = _run(config).model
  kw = dict(max_seq_len=m.max_seq_len, dtype=m.dtype, param_dtype=m.param_dtype)
  if model:
    mcfg = presets.get_preset(model, **kw, **pretrained.execution_fields(m))
  elif pretrained.source(m) == "hf":  # as pretrained.load_model: execution fields after
    mcfg = dataclasses.replace(
        hf.config_from_hf(hf.read_hf_config(pretrained.checkpoint_dir(m)), **kw),
        **pretrained.execution_fields(m))
  elif pretrained.source(m) == "gguf":
    raise ValueError("--model is needed with model.gguf (the plan reads no GGUF file): give a "
                     "preset name from sao_jax/models/presets.py, e.g. --model=smollm2-135m.")
  else:
    vocab = (pretrained.load_tokenizer(m) or CharTokenizer()).vocab_size
    mcfg = dataclasses.replace(pretrained.model_config(m, vocab),
                               param_dtype=kw["param_dtype"])
  if layers:
    mcfg = with_layers(mcfg, layers)
  return mcfg


def with_layers(mcfg, n: int):
  """``mcfg`` with its first ``n`` blocks (MoE layers among them kept MoE)."""
  return dataclasses.replace(mcfg, n_layers=n,
                             moe_layers=tuple(i for i in mcfg.moe_layers if i < n))


def abstract_params(module_cls, mcfg):
  """(graphdef, pure-dict params of ``jax.ShapeDtypeStruct``) of ``module_cls(mcfg)``: shapes
  and dtypes only, nothing allocated (``nnx.eval_shape``)."""
  from flax import nnx  # pylint: disable=import-outside-toplevel
  graphdef, state = nnx.split(nnx.eval_shape(lambda: module_cls(mcfg, rngs=nnx.Rngs(0))))
  return graphdef, nnx.to_pure_dict(state)


def count_params(params) -> int:
  """Number of parameters in a pytree of arrays or ``ShapeDtypeStruct``s."""
  import jax  # pylint: disable=import-outside-toplevel
  return int(sum(math.prod(x.shape) for x in jax.tree.leaves(params)))


def chip_bytes(tree) -> int:
  """Bytes of one chip's shard of a pytree of ``ShapeDtypeStruct``s with shardings (the
  largest shard; shards are equal for the even splits the mesh rules choose)."""
  import jax  # pylint: disable=import-outside-toplevel
  total = 0
  for x in jax.tree.leaves(tree):
    shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
    total += math.prod(shape) * x.dtype.itemsize  # (PRNG key dtypes have one too)
  return int(total)


# ---- compiling ---------------------------------------------------------------------------------
@dataclasses.dataclass
class Program:
  """One compiled program's per-chip numbers (bytes; FLOPs per call; ``calls`` per policy step)."""
  name: str
  argument: float
  output: float
  alias: float
  temp: float
  resident: float
  flops: float
  xla_peak: float = 0.0  # XLA's own peak estimate (``peak_memory_in_bytes``), for comparison
  refused: bool = False  # XLA refused it at the chip's HBM (bytes from its message)
  crashed: bool = False  # the compiler crashed on it: nothing is known
  calls: int = 1
  learner: bool = True
  key: str = ""  # "targets" / "critic" / "policy" for the learner's steps
  compile_s: float = 0.0

  @property
  def total(self) -> float:
    return self.argument + self.output - self.alias + self.temp + self.resident


def _compiled_numbers(compiled) -> dict:
  mem = compiled.memory_analysis()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return dict(argument=float(mem.argument_size_in_bytes), output=float(mem.output_size_in_bytes),
              alias=float(mem.alias_size_in_bytes), temp=float(mem.temp_size_in_bytes),
              flops=float((cost or {}).get("flops", 0.0)),
              xla_peak=float(getattr(mem, "peak_memory_in_bytes", 0) or 0))


_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def refused_temp_bytes(message: str) -> float:
  """The temporaries XLA said a refused program needs ("... memory required for HLO temporaries
  (26.42G) exceeds available HBM (15.75G)"), in bytes; NaN when the message has no such number."""
  m = re.search(r"HLO temporaries \(([\d.]+)([KMGT]?)\)", message)
  return float(m.group(1)) * _UNITS[m.group(2)] if m else float("nan")


def _compile(fn, *args, **kwargs) -> tuple[dict, float]:
  """Lowers and compiles ``fn`` for the abstract ``args``; returns (numbers, seconds).

  XLA's TPU compiler refuses a program whose buffers exceed the chip's HBM (RESOURCE_EXHAUSTED,
  after it tried to fit it). Such a program's numbers are then formed from what is known:
  argument, output and alias bytes from the abstract arguments and outputs, temporaries from
  XLA's message, FLOPs unknown (NaN); ``numbers["refused"]`` is True."""
  import jax  # pylint: disable=import-outside-toplevel
  t0 = time.time()
  lowered = fn.lower(*args, **kwargs)
  try:
    numbers = dict(_compiled_numbers(lowered.compile()), refused=False)
  except jax.errors.JaxRuntimeError as e:
    if "RESOURCE_EXHAUSTED" not in str(e):
      raise
    infos = jax.tree.leaves(lowered.args_info[0])
    donated = [a for a, i in zip(jax.tree.leaves(args), infos) if i.donated]
    numbers = dict(argument=float(chip_bytes(args)), output=float(chip_bytes(lowered.out_info)),
                   alias=float(chip_bytes(donated)), temp=refused_temp_bytes(str(e)),
                   flops=float("nan"), xla_peak=float("nan"), refused=True)
  return numbers, time.time() - t0


def _with_sharding(tree, sharding):
  import jax  # pylint: disable=import-outside-toplevel
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)


def abstract_batch(rows: int, length: int, sharding):
  """A ``Batch`` of ``rows`` x ``length`` as ``ShapeDtypeStruct``s with ``sharding``."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  from sao_jax.train.batch import Batch  # pylint: disable=import-outside-toplevel
  host = Batch.of(np.zeros((rows, length), np.int32), np.zeros((rows, length), np.int8))
  return _with_sharding(host, sharding)


@dataclasses.dataclass
class _Steps:
  """An abstract learner and the abstract arguments of its steps on the config's batch."""
  learner: Any
  rows: int
  length: int
  micro: int
  fns: tuple  # (targets, critic, policy, metrics) jitted
  batch: Any
  critic_params: Any
  targets: Any


def _abstract_steps(config, mcfg, mesh, micro: Optional[int] = None, rows: int = 0,
                    **overrides) -> _Steps:
  """``Learner`` on ``mesh`` with abstract params of ``mcfg`` (``train`` fields replaced
  by ``overrides``), its steps for ``micro`` micro-batches and ``rows`` rows (default: the
  learner's plan for ``train.batch_size`` rows of ``model.max_seq_len`` tokens) and their
  abstract arguments."""
  import jax  # pylint: disable=import-outside-toplevel
  # pylint: disable=import-outside-toplevel
  from sao_jax.models.transformer import Critic, Transformer
  from sao_jax.train.learner import Learner, LearnerConfig

  cfg = LearnerConfig.from_run(_run(config), **overrides)
  pg, pp = abstract_params(Transformer, mcfg)
  cg, cp = abstract_params(Critic, mcfg) if cfg.spec.uses_critic else (None, None)
  learner = Learner(cfg, pg, pp, cg, cp, pad_id=0, vocab_size=mcfg.vocab_size, mesh=mesh)
  length = int(config.model.max_seq_len)
  planned_rows, planned = learner.plan(int(config.train.batch_size), length)
  micro = planned if micro is None else micro
  rows = rows or planned_rows
  fns = learner.jitted_steps(micro)
  batch = abstract_batch(rows, length, learner.batch_sharding)
  critic = learner.critic.params if learner.uses_critic else None
  targets = _with_sharding(jax.eval_shape(fns[0], critic, batch), learner.batch_sharding)
  return _Steps(learner, rows, length, micro, fns, batch, critic, targets)


LEARNER_PROGRAMS = ("targets", "critic", "policy")
ENGINE_PROGRAMS = ("prefill", "decode")


def learner_programs(config, mcfg, mesh, keys: Sequence[str] = LEARNER_PROGRAMS,
                     log=print, on_start=None, on_done=None) -> tuple[list[Program], dict]:
  """Compiles the learner's steps named in ``keys`` ("targets", "critic", "policy") for ``mesh``
  (TPU devices) with abstract params of ``mcfg``.

  Returns (programs, info): per-chip bytes of each step (FLOPs: ``learner_flops``; the critic
  update's ``calls`` = K per policy step); info holds the rows, length, micro-batches, critic
  updates and tokens per step. A critic-free estimator has no critic update. ``on_start(key)``
  and ``on_done(program)`` are called around each compile."""
  st = _abstract_steps(config, mcfg, mesh)
  learner, (targets_fn, critic_fn, policy_fn, _, first_fn) = st.learner, st.fns
  ref = learner._ref  # pylint: disable=protected-access
  # with a critic the learner runs the targets and the first critic update as one program
  # (``first_critic``: one critic forward for both), then K - 1 plain critic updates
  k = learner.cfg.train.critic_updates_per_step - 1 if learner.uses_critic else 0
  minis = max(1, learner.cfg.train.policy_minibatches)
  # what the learner holds on the chips through a whole step, argument of a program or not
  held = sum(chip_bytes(t) for t in (learner.policy, learner.critic, ref, st.batch))
  label = f"{st.micro} micro-batch{'es' if st.micro > 1 else ''}"
  names = {"targets": (f"targets + critic update 1 ({label})" if learner.uses_critic
                       else f"targets ({st.rows}x{st.length})"),
           "critic": f"critic update ({label})",
           "policy": f"policy update ({label}" + (f", {minis} mini-batches)" if minis > 1 else ")")}
  calls = {"targets": ((first_fn, (learner.critic, st.batch)) if learner.uses_critic
                       else (targets_fn, (st.critic_params, st.batch))),
           "critic": (critic_fn, (learner.critic, st.batch, st.targets)),
           "policy": (policy_fn, (learner.policy, st.batch, st.targets["advantages"], ref))}
  out = []
  for key in keys:
    if key == "critic" and not k:
      continue
    log(f"  compiling {names[key]}")
    if on_start:
      on_start(key)
    n, s = _compile(calls[key][0], *calls[key][1])
    extra = chip_bytes(st.targets) if key != "targets" else 0  # the targets outlive it
    out.append(Program(names[key], resident=held + extra - n["argument"], compile_s=s,
                       calls=k if key == "critic" else 1, key=key, **n))
    if on_done:
      on_done(out[-1])
  info = dict(rows=st.rows, length=st.length, microbatches=st.micro, policy_minibatches=minis,
              critic_updates=k, tokens_per_step=st.rows * st.length,
              mesh={name: int(size) for name, size in mesh.shape.items()})
  return out, info


def routed_flops_equivalent(mcfg):
  """A model config with the FLOPs of ``mcfg``'s routed MoE, for counting them by tracing.

  XLA:CPU lowers ``jax.lax.ragged_dot`` to a masked dense product over every expert, so tracing
  a routed MoE on CPU counts all ``n_experts`` experts for every token. When every layer is a
  MoE layer this returns the dense model whose SwiGLU MLP is ``n_experts_per_tok * moe_d_ff``
  wide: each token then multiplies by as many weights as its k routed experts hold together,
  forward and backward (2 N k D F FLOPs per projection). The router's ``[d_model, n_experts]``
  matmul is left out (for Qwen3-30B-A3B, 128 / (3 x 8 x 768), under 1% of the experts' FLOPs).
  Dense models, and models mixing dense and MoE layers (whose two MLP widths one dense config
  cannot hold), are returned unchanged."""
  moe = tuple(getattr(mcfg, "moe_layers", ()))
  if not moe or len(moe) != mcfg.n_layers:
    return mcfg
  return dataclasses.replace(mcfg, d_ff=mcfg.n_experts_per_tok * mcfg.moe_d_ff, moe_layers=(),
                             n_experts=0, n_experts_per_tok=0, moe_d_ff=0)


def learner_flops(config, mcfg, rows: int = 0) -> dict[str, float]:
  """Model FLOPs of each learner step on the whole batch of ``rows`` rows (default: the plan
  for one device): {"targets", "critic", "policy"} (one call each; "critic" absent for a
  critic-free estimator).

  Counted by XLA's cost analysis of the steps as traced (``Lowered.cost_analysis`` on one CPU
  device: seconds, nothing compiled), at full depth, without remat (its recomputed forward is
  not model FLOPs), a routed MoE as its routed FLOPs (``routed_flops_equivalent``), with one
  micro-batch and one mini-batch -- the cost analysis counts a loop body once, and
  micro-batching does not change the arithmetic (the old-policy forward of
  ``train.policy_minibatches`` > 1 is left out). Per chip, ``plan`` divides these by the learner's
  chip count (the model-FLOPs convention of MFU: compute a partitioning repeats on several chips is
  not counted)."""
  import jax  # pylint: disable=import-outside-toplevel
  from sao_jax.train import sharding  # pylint: disable=import-outside-toplevel

  if "scan_layers" in {f.name for f in dataclasses.fields(mcfg)}:
    # a scan counts as one layer; remat's recomputed forward is not model FLOPs
    mcfg = dataclasses.replace(mcfg, scan_layers=False, remat="none")
  mcfg = routed_flops_equivalent(mcfg)
  mesh = sharding.make_mesh({"data": 1}, devices=jax.devices("cpu")[:1])
  st = _abstract_steps(config, mcfg, mesh, micro=1, rows=rows, policy_minibatches=1)
  learner, (targets_fn, critic_fn, policy_fn, _, first_fn) = st.learner, st.fns
  flops = lambda lowered: float((lowered.cost_analysis() or {}).get("flops", float("nan")))
  if learner.uses_critic:  # targets + the first critic update, as the learner runs them
    out = {"targets": flops(first_fn.lower(learner.critic, st.batch))}
  else:
    out = {"targets": flops(targets_fn.lower(st.critic_params, st.batch))}
  if learner.uses_critic:
    out["critic"] = flops(critic_fn.lower(learner.critic, st.batch, st.targets))
  out["policy"] = flops(policy_fn.lower(learner.policy, st.batch, st.targets["advantages"],
                                        learner._ref))  # pylint: disable=protected-access
  return out


def engine_programs(config, mcfg, mesh, keys: Sequence[str] = ENGINE_PROGRAMS,
                    log=print, on_start=None, on_done=None) -> list[Program]:
  """Compiles the rollout engine's programs named in ``keys`` on ``mesh`` (the rollout sub-mesh
  of ``build.make_meshes``, axes data / tensor / expert; or one chip), params and decode state
  laid out as the engine holds them (``SAOEngine.param_shardings``, ``state_shardings``):
  "prefill" (``prefill_insert`` of ``rollout.slots`` fresh prompts of
  ``rollout.max_prefill_length`` tokens: the most one call takes) and "decode" (one decode step
  of every slot over the whole KV cache: ``generate``). ``on_start(key)`` and
  ``on_done(program)`` are called around each compile."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from jax.sharding import NamedSharding  # pylint: disable=import-outside-toplevel
  from jax.sharding import PartitionSpec as P  # pylint: disable=import-outside-toplevel
  from sao_jax.models.transformer import Transformer  # pylint: disable=import-outside-toplevel
  from sao_jax.rollout.engine import SAOEngine  # pylint: disable=import-outside-toplevel

  slots, t = int(config.rollout.slots), int(config.rollout.max_prefill_length)
  rep = NamedSharding(mesh, P())
  split = NamedSharding(mesh, P("data" if "data" in mesh.axis_names else None))
  graphdef, params = abstract_params(Transformer, mcfg)
  engine = SAOEngine(mcfg, graphdef, None, max_concurrent_decodes=slots, max_prefill_length=t,
                     mesh=mesh)
  params = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), params,
                        engine.param_shardings(params))
  state = jax.eval_shape(lambda: engine.init_decode_state(0).replace(host_lengths=None))
  state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state,
                       engine.state_shardings)
  row = lambda dtype: jax.ShapeDtypeStruct((slots,), dtype, sharding=split)
  key = _with_sharding(jax.eval_shape(lambda: (jax.random.key(0), jnp.uint32(0))), rep)
  temp = jax.ShapeDtypeStruct((), jnp.float32, sharding=rep)
  where = f"{mesh.size} chip{'s' if mesh.size > 1 else ''}"  # the layout: the report's header
  # pylint: disable=protected-access
  calls = {
      "prefill": (f"engine prefill ({slots}x{t}, {where})", engine._prefill_insert_jit,
                  (params, state, row(jnp.int32),
                   jax.ShapeDtypeStruct((slots, t), jnp.int32, sharding=split), row(jnp.int32),
                   row(jnp.int32), row(jnp.int32), key, temp), {"kv_len": t}),
      "decode": (f"engine decode step ({slots} slots, {where})", engine._generate_jit,
                 (params, state, temp), {"kv_len": None})}
  out = []
  for key in keys:
    name, fn, args, kwargs = calls[key]
    log(f"  compiling {name}")
    if on_start:
      on_start(key)
    n, s = _compile(fn, *args, **kwargs)
    out.append(Program(name, resident=0.0, learner=False, calls=0, compile_s=s, key=key, **n))
    if on_done:
      on_done(out[-1])
  return out


def extrapolate(at: dict[int, list[Program]], depth: int) -> list[Program]:
  """Programs at ``depth`` from the same programs compiled at two depths (linear in depth)."""
  (d1, p1), (d2, p2) = sorted(at.items())
  out = []
  for a, b in zip(p1, p2):
    fit = lambda x, y: x + (y - x) * (depth - d1) / (d2 - d1)
    fields = {f: fit(getattr(a, f), getattr(b, f))
              for f in ("argument", "output", "alias", "temp", "resident", "flops", "xla_peak")}
    out.append(dataclasses.replace(a, compile_s=a.compile_s + b.compile_s,
                                   refused=a.refused or b.refused,
                                   crashed=a.crashed or b.crashed, **fields))
  return out


def parse_depths(text: str, n_layers: int) -> Optional[tuple[int, int]]:
  """``--depths``: "full" (None: compile the whole model), "auto" (1,2 when the model has more
  than 2 layers; ``n_layers`` 0 = a scanned stack, compiled whole) or "A,B" with 1 <= A < B.
  Raises ValueError naming ``--depths``."""
  text = text.strip().lower()
  if text == "full" or (text == "auto" and n_layers <= 2):
    return None
  if text == "auto":
    return (1, 2)
  try:
    a, b = (int(v) for v in text.split(","))
  except ValueError:
    a = b = 0
  if not 1 <= a < b:
    raise ValueError(f"--depths={text!r}: give 'auto', 'full' or two depths 'A,B', 1 <= A < B.")
  return (a, b)


def measure_in_process(config, sl: Slice, mcfg, items, log=print, emit=None):
  """Compiles ``items`` ((key, depth) pairs; keys of ``LEARNER_PROGRAMS`` /
  ``ENGINE_PROGRAMS``) for the slice in this process. Returns ({(key, depth): Program}, info of
  the learner). ``emit(kind, payload)`` (the worker's protocol) hears "start" before each
  compile, "done" after it and "info" once."""
  from sao_jax import build  # pylint: disable=import-outside-toplevel
  devices = slice_devices(sl)
  # the main job's split (build.make_meshes): rollout.devices N > 0 gives the engine the first N
  # chips laid out as rollout.mesh and the learner the rest; N = 0 plans the engine on one chip
  mesh, engine_mesh = build.make_meshes(_run(config), devices)
  if engine_mesh is None:
    engine_mesh = _one_chip_mesh(devices[0])
  emit = emit or (lambda kind, payload: None)
  results, info = {}, {}
  for depth in sorted({d for _, d in items}):
    cfg_d = with_layers(mcfg, depth)
    log(f"{depth} layer{'s' if depth > 1 else ''}:")

    def done(p, depth=depth):
      results[p.key, depth] = p
      emit("done", dict(dataclasses.asdict(p), depth=depth))

    hooks = dict(on_start=lambda key, depth=depth: emit("start", f"{key}@{depth}"), on_done=done)
    keys = [k for k, d in items if d == depth]
    _, info = learner_programs(config, cfg_d, mesh, [k for k in keys if k in LEARNER_PROGRAMS],
                               log=log, **hooks)
    emit("info", info)
    engine_keys = [k for k in keys if k in ENGINE_PROGRAMS]
    if engine_keys:
      engine_programs(config, cfg_d, engine_mesh, engine_keys, log=log, **hooks)
  return results, info


def _one_chip_mesh(device):
  """A one-chip engine mesh (axis ``data`` of size 1) on ``device``."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  from jax.sharding import Mesh  # pylint: disable=import-outside-toplevel
  return Mesh(np.array([device]), ("data",))


# a worker dying of these while compiling is a compiler crash; others (SIGTERM, SIGKILL) stop
CRASH_SIGNALS = (signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS, signal.SIGILL, signal.SIGFPE)
MARK = "SAO_PLAN"  # worker protocol lines on stdout: "SAO_PLAN <kind> <payload>"


LABELS = {"targets": "targets", "critic": "critic update", "policy": "policy update",
          "prefill": "engine prefill", "decode": "engine decode step"}


def measure_isolated(argv: Sequence[str], command: Optional[Sequence[str]] = None):
  """A runner for ``plan``: the compiles run in a child ``python -m sao_jax.plan`` (the same
  flags plus ``--items``), so a crash of XLA's TPU compiler (a segfault in libtpu, seen on
  v5e for the engine's prefill of ``configs/aime.py``) loses one program, not the plan: the
  program it was compiling is reported as crashed and a new child goes on with the rest.
  ``command``: the child's command before ``argv`` (default ``python -m sao_jax.plan``). A child
  that fails otherwise (exit status > 0, or a crash outside a compile) raises RuntimeError."""
  command = list(command or [sys.executable, "-m", "sao_jax.plan"])

  def run(config, sl, mcfg, items, log=print):
    del config, sl, mcfg
    results, info, todo = {}, {}, [f"{k}@{d}" for k, d in items]
    while todo:
      child = subprocess.Popen([*command, *argv, f"--items={','.join(todo)}"],
                               stdout=subprocess.PIPE, text=True)
      started = None
      for line in child.stdout:
        if not line.startswith(MARK + " "):
          continue
        _, kind, payload = line.rstrip("\n").split(" ", 2)
        if kind == "start":
          started = payload
        elif kind == "info":
          info = json.loads(payload)
        elif kind == "done":
          d = json.loads(payload)
          depth = d.pop("depth")
          results[d["key"], depth] = Program(**d)
          todo.remove(f"{d['key']}@{depth}")
          started = None
      rc = child.wait()
      if rc > 0 or (rc < 0 and (started is None or -rc not in CRASH_SIGNALS)):
        raise RuntimeError(f"the compile worker stopped with exit status {rc} (its messages are "
                           "above)")
      if rc < 0:  # the compiler crashed while compiling ``started``
        key, depth = started.split("@")
        log(f"  XLA's TPU compiler crashed (signal {-rc}) compiling {key} at {depth} layers; "
            "going on without it")
        nan = float("nan")
        results[key, int(depth)] = Program(f"{LABELS[key]} (compiler crashed)", argument=nan,
                                           output=nan,
                                           alias=nan, temp=nan, resident=nan, flops=nan,
                                           xla_peak=nan, crashed=True, key=key,
                                           learner=key in LEARNER_PROGRAMS,
                                           calls=0 if key in ENGINE_PROGRAMS else 1)
        todo.remove(started)
    return results, info
  return run


def plan(config, sl: Slice, *, model: str = "", layers: int = 0, depths: str = "auto",
         mfu: float = 0.4, hbm_bytes: Optional[float] = None, engine: bool = True,
         log=print, runner=None) -> dict:
  """Compiles the config's programs for the slice; returns the report (``--json`` writes it).
  ``runner``: how the compiles run (default ``measure_in_process``; the command line uses
  ``measure_isolated``).

  Keys: slice, chip, chips, topology, hbm_bytes, peak_flops, mfu, model (name, layers,
  params), mesh (the learner's), learner_chips, rollout_devices, rollout_mesh (None when the
  engine shares a chip), rows, length, microbatches, critic_updates, depths (None or the two
  compiled depths), compiled (depth -> the programs as compiled at that depth), programs (list
  of dicts: name, key, argument, output, alias, temp, resident, total, flops, calls, learner,
  refused, crashed, fits, compile_s), step_flops (per chip, one policy step), step_time_s, fits,
  advice (list of str). Raises ValueError on a bad config or arguments."""
  from sao_jax.models.transformer import Transformer  # pylint: disable=import-outside-toplevel
  from sao_jax.rollout import placement  # pylint: disable=import-outside-toplevel
  from sao_jax.train.validation import validate_config  # pylint: disable=import-outside-toplevel

  if not 0 < mfu <= 1:
    raise ValueError(f"--mfu={mfu}: a fraction of the chip's peak, in (0, 1].")
  if not config.mesh.shape and sl.chips > 1:
    raise ValueError(f"mesh.shape is empty (one device) but {sl.topology} has {sl.chips} chips; "
                     "set --config.mesh.shape, e.g. fsdp=-1.")
  checked = config.copy_and_resolve_references()
  checked.allow_random_init = True  # the plan loads no weights: no checkpoint is needed
  validate_config(checked, num_devices=sl.chips)
  mcfg = model_config(config, model, layers)
  # a scanned layer stack compiles in time flat in depth: plan it whole ("auto")
  fit_depths = parse_depths(depths, 0 if getattr(mcfg, "scan_layers", False) else mcfg.n_layers)
  items = [(key, depth) for depth in (fit_depths or (mcfg.n_layers,))
           for key in LEARNER_PROGRAMS + (ENGINE_PROGRAMS if engine else ())]
  results, info = (runner or measure_in_process)(config, sl, mcfg, items, log)
  compiled: dict[int, list[Program]] = {}
  for key, depth in items:
    if (key, depth) in results:
      compiled.setdefault(depth, []).append(results[key, depth])
  if not info:
    raise RuntimeError("no learner program compiled (see the messages above).")
  as_compiled = {str(d): [dataclasses.asdict(p) for p in ps] for d, ps in compiled.items()}
  programs = extrapolate(compiled, mcfg.n_layers) if fit_depths else compiled[mcfg.n_layers]
  for p in programs:  # (a crashed program's placeholder does not know its call count)
    p.calls = info["critic_updates"] if p.key == "critic" else int(p.learner)
  learner_chips = math.prod(info["mesh"].values())  # the slice less rollout.devices
  log("counting the learner's FLOPs (traced on one CPU device)")
  model_flops = learner_flops(config, mcfg, rows=info["rows"])
  for p in programs:
    if p.learner:
      p.flops = model_flops[p.key] / learner_chips
  hbm = float(hbm_bytes if hbm_bytes else sl.chip.hbm_bytes)
  step_flops = sum(p.flops * p.calls for p in programs if p.learner)
  step_time = step_flops / (sl.chip.peak_flops * mfu)
  rows = []
  for p in programs:
    d = dataclasses.asdict(p)
    d.update(total=p.total, fits=p.total <= hbm and not (p.refused or p.crashed))
    rows.append(d)
  report = dict(
      slice=sl.name, chip=sl.chip.name, chips=sl.chips, topology=sl.topology, hbm_bytes=hbm,
      peak_flops=sl.chip.peak_flops, mfu=mfu,
      model=dict(name=model or "config.model", layers=mcfg.n_layers, d_model=mcfg.d_model,
                 params=count_params(abstract_params(Transformer, mcfg)[1]),
                 vocab_size=mcfg.vocab_size, n_experts=mcfg.n_experts, dtype=mcfg.dtype,
                 param_dtype=mcfg.param_dtype),
      mesh=info["mesh"], learner_chips=learner_chips,
      rollout_devices=int(config.rollout.devices),
      rollout_mesh=(placement.rollout_shape(config.rollout.mesh, int(config.rollout.devices))
                    if config.rollout.devices else None),
      tokens_per_device=int(config.mesh.tokens_per_device),
      rows=info["rows"], length=info["length"], microbatches=info["microbatches"],
      critic_updates=info["critic_updates"], tokens_per_step=info["tokens_per_step"],
      depths=list(fit_depths) if fit_depths else None,
      compiled=as_compiled,
      programs=rows, step_flops=step_flops,
      step_time_s=step_time, fits=all(r["fits"] for r in rows))
  report["advice"] = advice(config, report)
  return report


def advice(config, report: dict) -> list[str]:
  """One line per program that does not fit: what it needs and the config fields to change."""
  out = []
  hbm = report["hbm_bytes"]
  keys = _flat_keys(config)
  for r in report["programs"]:
    if r["fits"]:
      continue
    if r.get("crashed"):
      out.append(f"{r['name']}: XLA's TPU compiler crashed on it, so its memory is unknown; "
                 "check it on the slice, or plan a variant (other rollout.slots / "
                 "rollout.max_prefill_length / mesh.shape) to bracket it.")
      continue
    need = (f"{r['name']} needs {r['total'] / GIB:.3g} GiB per chip"
            + (" (XLA refused it at the chip's HBM)" if r["refused"] else "")
            + f", the chip has {hbm / GIB:.3g}")
    if r["learner"]:
      fixes = [f"mesh.shape (now {config.mesh.shape!r}): more chips along fsdp (a larger slice) "
               "or tensor/expert axes",
               f"mesh.tokens_per_device (now {report['tokens_per_device']}): fewer tokens per "
               "micro-batch, smaller activations"]
      if "model.remat" in keys:
        fixes.append(f"model.remat (now {config.model.remat!r}): recompute activations in the "
                     "backward pass")
      if r["argument"] + r["resident"] > hbm:
        need += (f"; its arguments and the states beside it alone take "
                 f"{(r['argument'] + r['resident']) / GIB:.3g} GiB, so only more chips help")
    else:
      fixes = [f"rollout.slots (now {config.rollout.slots}): fewer KV caches per chip",
               f"rollout.devices / rollout.mesh (now {config.rollout.devices} / "
               f"{config.rollout.mesh!r}): more chips, weights split over tensor / expert",
               f"rollout.max_prefill_length (now {config.rollout.max_prefill_length}) or "
               f"model.max_seq_len (now {config.model.max_seq_len}): shorter chunks and caches"]
    out.append(f"{need}; change " + "; ".join(fixes) + ".")
  return out


def _flat_keys(config, prefix: str = "") -> set:
  out = set()
  for k, v in config.items():
    if hasattr(v, "items"):
      out |= _flat_keys(v, f"{prefix}{k}.")
    else:
      out.add(f"{prefix}{k}")
  return out


def format_report(report: dict) -> str:
  """The table ``python -m sao_jax.plan`` prints (GiB per chip, MiB when every program is
  below 0.1 GiB; "n/a" where XLA refused a program and so gave no count)."""
  small = max(r["total"] for r in report["programs"]) < 0.1 * GIB
  unit, scale = ("MiB", 1 << 20) if small else ("GiB", GIB)
  size = lambda b: ("n/a" if math.isnan(b) else f"{b / scale:.0f}" if b >= 1000 * scale
                    else f"{b / scale:.2f}")
  tflop = lambda f: "n/a" if math.isnan(f) else f"{f / 1e12:.4g}"
  m = report["model"]
  lines = [
      f"slice {report['slice']}: {report['topology']}, {report['chips']} {report['chip']} chips, "
      f"{report['hbm_bytes'] / GIB:.1f} GiB HBM and {report['peak_flops'] / 1e12:.0f} TFLOP/s "
      "peak bf16 each",
      f"model {m['name']}: {m['params'] / 1e9:.3g}B parameters, {m['layers']} layers, d_model "
      f"{m['d_model']}, vocab {m['vocab_size']}"
      + (f", {m['n_experts']} experts" if m["n_experts"] else "")
      + f"; params {m['param_dtype']}, compute {m['dtype']}",
      (f"rollout on chips 0-{report['rollout_devices'] - 1} (rollout.devices), mesh "
       f"{report['rollout_mesh']}; learner on the other {report['learner_chips']}, "
       if report.get("rollout_devices") else "")
      + f"mesh {report['mesh']}; batch {report['rows']} rows x {report['length']} tokens in "
      f"{report['microbatches']} micro-batch(es) (mesh.tokens_per_device="
      f"{report['tokens_per_device']}); {report['critic_updates']} critic update(s) per step",
  ]
  if report["depths"]:
    d1, d2 = report["depths"]
    lines.append(f"EXTRAPOLATED: the bytes below are fitted linearly in depth from compiles at "
                 f"{d1} and {d2} layers to {m['layers']} (exact for the states, an estimate "
                 "for the temporaries; --depths=full compiles the whole model)")
  head = (f"{'program':<44}{'arg':>8}{'out':>8}{'temp':>8}{'other':>8}{'total':>8}{'HBM':>8}"
          f"{'fits':>6}{'TFLOP':>10}")
  lines += ["", f"per chip, {unit} (out: outputs not aliased to a donated argument; other: state "
            "the learner holds beside the program)", head, "-" * len(head)]
  for r in report["programs"]:
    name = r["name"] + (f" x{r['calls']}" if r["calls"] > 1 else "")
    lines.append(f"{name:<44}{size(r['argument']):>8}{size(r['output'] - r['alias']):>8}"
                 f"{size(r['temp']):>8}{size(r['resident']):>8}{size(r['total']):>8}"
                 f"{size(report['hbm_bytes']):>8}{'yes' if r['fits'] else 'NO':>6}"
                 f"{tflop(r['flops']):>10}")
  rate = report["tokens_per_step"] / report["step_time_s"] if report["step_time_s"] > 0 else 0
  lines += ["", f"one policy step (targets + first critic update, {report['critic_updates']} more "
            "critic update(s), 1 policy "
            f"update): {tflop(report['step_flops'])} TFLOP per chip (model FLOPs); at "
            f"{report['mfu']:.0%} MFU: {report['step_time_s']:.3g} s per step, {rate:,.0f} "
            "tokens/s per slice. Engine rows: TFLOP per call."]
  if report["fits"]:
    lines.append("FITS: every program fits the chip's HBM.")
  else:
    lines += ["DOES NOT FIT:"] + [f"  - {a}" for a in report["advice"]]
  return "\n".join(lines)


# ---- command line -------------------------------------------------------------------------------
def main(argv: Sequence[str]) -> int:
  from absl import flags  # pylint: disable=import-outside-toplevel
  del argv
  f = flags.FLAGS
  if f.config is None:
    print("--config is required, e.g. --config=configs/aime.py", file=sys.stderr)
    return 2
  try:
    sl = parse_slice(f.topology)
  except ValueError as e:
    print(e, file=sys.stderr)
    return 2
  if not libtpu_available():
    print(INSTALL_HINT, file=sys.stderr)
    return 2
  log = lambda msg: print(msg, file=sys.stderr, flush=True)
  if f.items:  # a compile worker of measure_isolated: results on stdout, one line each
    emit = lambda kind, payload: print(f"{MARK} {kind} {json.dumps(payload)}"
                                       if kind != "start" else f"{MARK} start {payload}",
                                       flush=True)
    items = [(k, int(d)) for k, d in (i.split("@") for i in f.items.split(","))]
    measure_in_process(f.config, sl, model_config(f.config, f.model, f.layers), items, log, emit)
    return 0
  try:
    report = plan(f.config, sl, model=f.model, layers=f.layers, depths=f.depths, mfu=f.mfu,
                  hbm_bytes=f.hbm_gib * GIB if f.hbm_gib else None, engine=f.engine, log=log,
                  runner=measure_isolated(sys.argv[1:]))
  except ValueError as e:  # ConfigError is a ValueError: the fields to fix, no traceback
    print(e, file=sys.stderr)
    return 2
  print(format_report(report))
  if f.json:
    with open(f.json, "w", encoding="utf-8") as fh:
      json.dump(report, fh, indent=1)
  return 0 if report["fits"] else 1


def _define_flags():
  from absl import flags  # pylint: disable=import-outside-toplevel
  from ml_collections import config_flags  # pylint: disable=import-outside-toplevel
  config_flags.DEFINE_config_file("config", None, "Path to an ml_collections config file "
                                   "(`path.py` or `path.py:variant`).", lock_config=True)
  flags.DEFINE_string("topology", "v5litepod-8", "TPU slice: v5litepod-8, v5p-8, v5p-64, v6e-8, "
                      "... or a topology name such as v5e:2x4.")
  flags.DEFINE_string("model", "", "Model preset (sao_jax/models/presets.py), e.g. "
                      "qwen3-30b-a3b; default: the config's model.")
  flags.DEFINE_integer("layers", 0, "Plan a model with this many layers (0: the model's).")
  flags.DEFINE_string("depths", "auto", "'auto' (compile at 1 and 2 layers and extrapolate "
                      "when the model is deeper), 'full' or 'A,B'.")
  flags.DEFINE_float("mfu", 0.4, "Model FLOPs utilisation for the implied step time.")
  flags.DEFINE_float("hbm_gib", 0.0, "Override the chip's HBM (GiB); 0: the chip's.")
  flags.DEFINE_bool("engine", True, "Also plan the rollout engine's prefill and decode step.")
  flags.DEFINE_string("json", "", "Also write the report as JSON to this path.")
  flags.DEFINE_string("items", "", "Internal: run as a compile worker for these "
                      "'key@depth' items (measure_isolated).")


if __name__ == "__main__":
  from absl import app  # pylint: disable=ungrouped-imports
  from sao_jax import configs  # pylint: disable=ungrouped-imports
  _define_flags()
  app.run(lambda argv: sys.exit(main(argv)), flags_parser=configs.parse_flags)
