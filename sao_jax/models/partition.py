"""The one parameter-axis table: a logical axis name for every dimension of every parameter.

Each parameter of ``Transformer`` / ``Critic`` (pure-dict paths, see ``transformer.py``) gets a
tuple of logical axis names, one per dimension (the MaxText / ``flax.linen.partitioning``
convention):

==========================================  =====================================
``embed/embedding``                         ``("vocab", "embed")``
``attn/q_proj/kernel`` (``bias``)           ``("embed", "heads")`` (``("heads",)``)
``attn/{k,v}_proj/kernel`` (``bias``)       ``("embed", "kv_heads")`` (``("kv_heads",)``)
``attn/o_proj/kernel`` (``bias``)           ``("heads", "embed")`` (``("embed",)``)
``attn/{q,k}_norm/scale``                   ``("head_dim",)``
``*_norm/scale`` (block / final)            ``("norm",)`` (replicated)
``mlp/{gate,up}_proj/kernel``               ``("embed", "mlp")``
``mlp/down_proj/kernel``                    ``("mlp", "embed")``
``mlp/router/kernel``                       ``("embed", "expert")``
``mlp/{gate,up}_proj`` (MoE)                ``("expert", "embed", "mlp")``
``mlp/down_proj`` (MoE)                     ``("expert", "mlp", "embed")``
``lm_head/kernel``                          ``("embed", "vocab")``
``value_head/kernel`` / ``bias``            ``("embed", None)`` / ``(None,)``
==========================================  =====================================

``sao_jax.train.sharding`` maps the logical names to mesh axes (``LOGICAL_RULES``, MaxText
style) for the learner, the loaders and the checkpoints; nothing else names parameter axes.
"""

from __future__ import annotations

import re
from typing import Any

import jax

_RULES = [
    (r"(^|/)embed/embedding$", ("vocab", "embed")),
    (r"/attn/q_proj/kernel$", ("embed", "heads")),
    (r"/attn/q_proj/bias$", ("heads",)),
    (r"/attn/[kv]_proj/kernel$", ("embed", "kv_heads")),
    (r"/attn/[kv]_proj/bias$", ("kv_heads",)),
    (r"/attn/o_proj/kernel$", ("heads", "embed")),
    (r"/attn/o_proj/bias$", ("embed",)),
    (r"/attn/[qk]_norm/scale$", ("head_dim",)),
    (r"(^|/)(attn_norm|mlp_norm|final_norm)/scale$", ("norm",)),
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
