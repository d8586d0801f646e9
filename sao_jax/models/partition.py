"""Logical axis names for every parameter, and their mapping to mesh partition specs.

Each parameter of ``Transformer`` / ``Critic`` (pure-dict paths, see ``transformer.py``) gets a
tuple of logical axis names, one per dimension (the MaxText / ``flax.linen.partitioning``
convention):

==========================================  =====================================
``embed/embedding``                         ``("vocab", "embed")``
``attn/q_proj/kernel`` (``bias``)           ``("embed", "heads")`` (``("heads",)``)
``attn/{k,v}_proj/kernel`` (``bias``)       ``("embed", "kv_heads")`` (``("kv_heads",)``)
``attn/o_proj/kernel`` (``bias``)           ``("heads", "embed")`` (``("embed",)``)
``attn/{q,k}_norm/scale``                   ``("head_dim",)``
``*_norm/scale`` (block / final)            ``("embed",)``
``mlp/{gate,up}_proj/kernel``               ``("embed", "mlp")``
``mlp/down_proj/kernel``                    ``("mlp", "embed")``
``mlp/router/kernel``                       ``("embed", "expert")``
``mlp/{gate,up}_proj`` (MoE)                ``("expert", "embed", "mlp")``
``mlp/down_proj`` (MoE)                     ``("expert", "mlp", "embed")``
``lm_head/kernel``                          ``("embed", "vocab")``
``value_head/kernel`` / ``bias``            ``("embed", None)`` / ``(None,)``
==========================================  =====================================

``partition_specs(params, rules)`` maps them to ``jax.sharding.PartitionSpec`` with rules such as
``{"embed": "fsdp", "heads": "tensor", "mlp": "tensor", "expert": "expert"}`` (a logical name
absent from the rules, or mapped to None, is replicated).
"""

from __future__ import annotations

import re
from typing import Any, Mapping, Optional

import jax
from jax.sharding import NamedSharding, PartitionSpec

_RULES = [
    (r"(^|/)embed/embedding$", ("vocab", "embed")),
    (r"/attn/q_proj/kernel$", ("embed", "heads")),
    (r"/attn/q_proj/bias$", ("heads",)),
    (r"/attn/[kv]_proj/kernel$", ("embed", "kv_heads")),
    (r"/attn/[kv]_proj/bias$", ("kv_heads",)),
    (r"/attn/o_proj/kernel$", ("heads", "embed")),
    (r"/attn/o_proj/bias$", ("embed",)),
    (r"/attn/[qk]_norm/scale$", ("head_dim",)),
    (r"(^|/)(attn_norm|mlp_norm|final_norm)/scale$", ("embed",)),
    (r"/mlp/(gate|up)_proj/kernel$", ("embed", "mlp")),
    (r"/mlp/down_proj/kernel$", ("mlp", "embed")),
    (r"/mlp/router/kernel$", ("embed", "expert")),
    (r"/mlp/(gate|up)_proj$", ("expert", "embed", "mlp")),
    (r"/mlp/down_proj$", ("expert", "mlp", "embed")),
    (r"(^|/)lm_head/kernel$", ("embed", "vocab")),
    (r"(^|/)value_head/kernel$", ("embed", None)),
    (r"(^|/)value_head/bias$", (None,)),
]


def param_path(path) -> str:
  """'layers/0/attn/q_proj/kernel' for a pytree key path (dict keys, sequence indices, attrs)."""
  parts = []
  for k in path:
    for attr in ("key", "idx", "name"):
      if hasattr(k, attr):
        parts.append(str(getattr(k, attr)))
        break
  return "/".join(parts)


def axes_for_path(path: str, ndim: int) -> tuple:
  """Logical axis names of the parameter at ``path`` ('layers/0/attn/q_proj/kernel').

  Raises ValueError for a path no rule covers or a rank that does not match its rule."""
  for pat, axes in _RULES:
    if re.search(pat, path):
      if len(axes) != ndim:
        raise ValueError(f"parameter {path} has rank {ndim}, its logical axes {axes} say "
                         f"{len(axes)}.")
      return axes
  raise ValueError(f"no logical axes for parameter {path!r}; add a rule to "
                   f"sao_jax/models/partition.py.")


def logical_axes(params: Any) -> Any:
  """Pytree like ``params`` whose leaves are tuples of logical axis names."""
  return jax.tree_util.tree_map_with_path(lambda p, x: axes_for_path(param_path(p), x.ndim),
                                          params)


def partition_specs(params: Any, rules: Mapping[str, Optional[Any]]) -> Any:
  """Pytree of ``PartitionSpec`` from logical axes and ``rules`` (logical name -> mesh axis name,
  tuple of mesh axes, or None). A mesh axis is used at most once per parameter (a later
  dimension that maps to an axis already used is replicated)."""

  def spec(axes):
    used, out = set(), []
    for a in axes:
      m = rules.get(a) if a is not None else None
      ms = m if isinstance(m, tuple) else (m,)
      if m is None or any(x in used for x in ms):
        out.append(None)
      else:
        used.update(ms)
        out.append(m)
    return PartitionSpec(*out)

  return jax.tree.map(spec, logical_axes(params), is_leaf=lambda x: isinstance(x, tuple))


def named_shardings(params: Any, mesh: jax.sharding.Mesh, rules: Mapping[str, Any]) -> Any:
  """``NamedSharding``s on ``mesh`` for ``params`` (pass to the loaders' ``shardings=``)."""
  return jax.tree.map(lambda s: NamedSharding(mesh, s), partition_specs(params, rules),
                      is_leaf=lambda x: isinstance(x, PartitionSpec))
