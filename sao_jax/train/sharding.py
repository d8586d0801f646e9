"""Meshes, logical-axis rules and the shardings of train states and batches.

Everything here is driven by configuration, never by device counts written in code:

* ``make_mesh(shape)`` builds a ``jax.sharding.Mesh`` from ``{"data": 1, "fsdp": -1, ...}``
  (one axis may be ``-1`` = "all remaining devices", so one config runs on 1, 8 or 256 devices),
  with explicit ``axis_types`` (``Auto``: GSPMD propagates shardings between the annotated
  inputs/outputs, the pjit style).
* Parameters get **logical axis names** from the model's one table
  (``sao_jax.models.partition``: ``layers/0/attn/q_proj/kernel`` -> ``("embed", "heads")``), and
  **logical-axis rules** (``LOGICAL_RULES``) map each logical name to mesh axes, as in MaxText /
  flax ``logical_to_mesh_axes``. A mesh axis is used at most once per array and is dropped for a
  dimension it does not divide (that dimension is then replicated along it), so any mesh works
  for any model shape.
* Optimizer states are sharded like their parameters (``optax.tree_map_params``); batches are
  sharded on their leading (row) dimension along the ``batch`` rule (``data``/``fsdp``/...).

A parameter the model's table does not name is an error (so a new layer is never silently
replicated); the table is the place to add it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Optional, Sequence

import jax
import optax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from sao_jax.models import partition
from sao_jax.train.steps import TrainState

MESH_AXES = ("data", "fsdp", "tensor", "expert")

# logical axis -> mesh axes, in priority order (MaxText style). "batch" shards the rows of every
# batch; "embed" shards the model width FSDP/ZeRO-3 style (over "expert" too, so non-expert
# parameters are not replicated across expert groups); "expert" shards MoE experts.
LOGICAL_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("batch", ("data", "fsdp", "expert")),
    ("vocab", ("tensor",)),
    ("embed", ("fsdp", "expert")),
    ("heads", ("tensor",)),
    ("kv_heads", ("tensor",)),
    ("mlp", ("tensor",)),
    ("expert", ("expert",)),
    ("norm", ()),
    ("head_dim", ()),
    ("length", ()),
)

# the rollout engine's table (``SAOEngine(mesh=)``): decode slots along "data", weights along
# "tensor" (attention heads and KV heads, MLP hidden, vocabulary) and "expert" (MoE experts),
# the model width replicated (no FSDP gathers per decode step). Its KV cache uses the same
# names: [slots, kv_heads, head_dim | length, length | head_dim].
ROLLOUT_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("batch", ("data",)),
    ("vocab", ("tensor",)),
    ("embed", ()),
    ("heads", ("tensor",)),
    ("kv_heads", ("tensor",)),
    ("mlp", ("tensor",)),
    ("expert", ("expert",)),
    ("norm", ()),
    ("head_dim", ()),
    ("length", ()),
)

@dataclasses.dataclass(frozen=True)
class StepShardings:
  """Shardings handed to the train-step factories in ``sao_jax.train.steps``.

  Attributes:
    mesh: the device mesh.
    state: sharding pytree of the ``TrainState`` (params and optimizer state), or None for
      steps that take params only.
    params: sharding pytree of the params alone.
    batch: sharding applied (as a pytree prefix) to every batch array: rows along ``batch``.
    logits_spec: PartitionSpec constraint on logits ``[B, T, V]`` inside the loss.
    values_spec: PartitionSpec constraint on per-token arrays ``[B, T]`` (values, log-probs).
  """
  mesh: Mesh
  state: Any
  params: Any
  batch: NamedSharding
  logits_spec: P
  values_spec: P

  @property
  def replicated(self) -> NamedSharding:
    return NamedSharding(self.mesh, P())

  def constrain(self, x: jax.Array, spec: P) -> jax.Array:
    """``with_sharding_constraint`` on this mesh (an activation sharding hint for GSPMD)."""
    return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))


def make_mesh(shape: Mapping[str, int], devices: Optional[Sequence[Any]] = None) -> Mesh:
  """A mesh with the axes of ``shape`` (in ``MESH_AXES`` order when they are standard names).

  Args:
    shape: axis name -> size, e.g. ``{"data": 1, "fsdp": 8}``; at most one size may be ``-1``,
      meaning "every device not used by the other axes". Sizes of 1 are kept (so rules can
      name every axis whatever the hardware).
    devices: devices to lay out (default ``jax.devices()``, all processes' devices).

  Returns:
    ``jax.sharding.Mesh`` with ``axis_types`` all ``AxisType.Auto``.

  Raises:
    ValueError if the product of the sizes differs from the number of devices, if more than
    one size is -1, or if a size is 0 or below -1 (the message names ``mesh.shape``).
  """
  devices = list(jax.devices() if devices is None else devices)
  if not shape:
    raise ValueError("mesh.shape is empty; give e.g. {'data': 1, 'fsdp': -1}.")
  names = sorted(shape, key=lambda n: MESH_AXES.index(n) if n in MESH_AXES else len(MESH_AXES))
  sizes = [int(shape[n]) for n in names]
  if sum(s == -1 for s in sizes) > 1:
    raise ValueError(f"mesh.shape={dict(shape)} has more than one -1 axis; keep one.")
  if any(s == 0 or s < -1 for s in sizes):
    raise ValueError(f"mesh.shape={dict(shape)}: sizes must be >= 1 (or one -1).")
  known = math.prod(s for s in sizes if s != -1)
  if -1 in sizes:
    if len(devices) % known:
      raise ValueError(f"mesh.shape={dict(shape)}: {len(devices)} devices are not a multiple of "
                       f"the fixed axes' product {known}.")
    sizes[sizes.index(-1)] = len(devices) // known
  if math.prod(sizes) != len(devices):
    raise ValueError(f"mesh.shape={dict(shape)} needs {math.prod(sizes)} devices, "
                     f"{len(devices)} are available; change mesh.shape (one axis may be -1).")
  return jax.make_mesh(tuple(sizes), tuple(names), axis_types=(AxisType.Auto,) * len(names),
                       devices=devices)


def logical_to_spec(axes: Sequence[Optional[str]], shape: Sequence[int], mesh: Mesh,
                    rules: Sequence[tuple[str, Sequence[str]]] = LOGICAL_RULES) -> P:
  """PartitionSpec for an array of ``shape`` whose dims have logical names ``axes``.

  Each dim takes, in rule order, the mesh axes of its logical name that are (a) in the mesh
  with size > 1, (b) not already used by an earlier dim, and (c) still divide the dim. So
  ``("expert", "embed", "mlp")`` on fsdp=2 x tensor=2 x expert=2 gives
  ``P("expert", "fsdp", "tensor")`` and ``("vocab", "embed")`` with vocab 63 on tensor=2 gives
  ``P(None, ...)``. Unknown logical names raise ValueError naming ``LOGICAL_RULES``.
  """
  table = {name: tuple(mesh_axes) for name, mesh_axes in rules}
  used: set[str] = set()
  spec = []
  for name, dim in zip(axes, shape):
    if name is None:
      spec.append(None)
      continue
    if name not in table:
      raise ValueError(f"logical axis {name!r} has no entry in the logical-axis rules "
                       f"{tuple(table)} (sao_jax/train/sharding.py:LOGICAL_RULES).")
    chosen, size = [], 1
    for ax in table[name]:
      n = mesh.shape.get(ax, 1)
      if n > 1 and ax not in used and dim % (size * n) == 0:
        chosen.append(ax)
        size *= n
    used.update(chosen)
    spec.append(None if not chosen else chosen[0] if len(chosen) == 1 else tuple(chosen))
  while spec and spec[-1] is None:
    spec.pop()
  return P(*spec)


def param_specs(params: Any, mesh: Mesh, rules=LOGICAL_RULES) -> Any:
  """PartitionSpec pytree for a params pytree (arrays or ``ShapeDtypeStruct``s), from the
  model's logical axes (``models.partition.logical_axes``) and ``rules``."""
  axes = partition.logical_axes(params)
  return jax.tree.map(lambda a, x: logical_to_spec(a, x.shape, mesh, rules), axes, params,
                      is_leaf=lambda x: isinstance(x, tuple))


def param_shardings(params: Any, mesh: Mesh, rules=LOGICAL_RULES) -> Any:
  """NamedSharding pytree for a params pytree."""
  return jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs(params, mesh, rules),
                      is_leaf=lambda x: isinstance(x, P))


def opt_state_shardings(tx: optax.GradientTransformation, params: Any, p_shardings: Any,
                        mesh: Mesh) -> Any:
  """Shardings of ``tx.init(params)``: every copy of the parameter tree inside the optimizer
  state (Adam ``mu``/``nu``, ...) is sharded like the parameters (``optax.tree_map_params``);
  other leaves (counts, schedule state) are replicated. Frozen leaves of
  ``optax.multi_transform(..., set_to_zero())`` hold no state (``MaskedNode``)."""
  state_shape = jax.eval_shape(tx.init, params)
  replicated = NamedSharding(mesh, P())
  masked = optax.transforms.MaskedNode
  return optax.tree_map_params(
      tx, lambda leaf, sh: leaf if isinstance(leaf, masked) else sh, state_shape, p_shardings,
      transform_non_params=lambda _: replicated, is_leaf=lambda x: isinstance(x, masked))


def batch_spec(mesh: Mesh, batch_size: Optional[int] = None, rules=LOGICAL_RULES) -> P:
  """Rows along the ``batch`` rule's mesh axes (those that divide ``batch_size`` if given)."""
  axes = logical_to_spec(("batch",), (batch_size or batch_shards(mesh, rules),), mesh, rules)
  return axes


def batch_shards(mesh: Mesh, rules=LOGICAL_RULES) -> int:
  """How many ways the ``batch`` rule splits the rows on this mesh (the row multiple a batch
  must have to be sharded on every batch axis)."""
  table = dict(rules)
  return math.prod(mesh.shape.get(ax, 1) for ax in table.get("batch", ()))


def make_step_shardings(mesh: Mesh, params: Any, tx: Optional[optax.GradientTransformation],
                        *, rules=LOGICAL_RULES) -> StepShardings:
  """All shardings a train step needs for ``params`` (and its ``TrainState`` under ``tx``)."""
  p_sh = param_shardings(params, mesh, rules)
  state_sh = None
  if tx is not None:
    state_sh = TrainState(params=p_sh, opt_state=opt_state_shardings(tx, params, p_sh, mesh),
                          step=NamedSharding(mesh, P()))
  row_axes = batch_spec(mesh, rules=rules)
  rows = row_axes[0] if len(row_axes) else None
  vocab = dict(rules).get("vocab", ())
  vocab = tuple(a for a in vocab if mesh.shape.get(a, 1) > 1) or None
  return StepShardings(mesh=mesh, state=state_sh, params=p_sh,
                       batch=NamedSharding(mesh, P(rows)),
                       logits_spec=P(rows, None, vocab), values_spec=P(rows, None))


def shard(tree: Any, shardings: Any) -> Any:
  """``jax.device_put`` of a (host or single-device) pytree onto the given shardings."""
  return jax.device_put(tree, shardings)


def abstract_like(tree: Any, shardings: Any) -> Any:
  """``ShapeDtypeStruct`` pytree with ``shardings``: a restore target for orbax that lays the
  checkpoint out on a (possibly different) mesh."""
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      tree, shardings)
