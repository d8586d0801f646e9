"""Optimizers with frozen parameters (the SAO critic's frozen attention)."""

from __future__ import annotations

import re
from typing import Any, Sequence

import jax
import optax

from sao_jax.models.partition import param_path  # noqa: F401  (re-exported)


def master_dtype(dtype) -> jax.numpy.dtype:
  """The dtype an optimizer keeps a parameter of ``dtype`` in: floating types narrower than
  float32 (bfloat16, float16) -> float32; float32 / float64 and non-floating types unchanged."""
  dtype = jax.numpy.dtype(dtype)
  if jax.numpy.issubdtype(dtype, jax.numpy.floating):
    return jax.numpy.promote_types(dtype, jax.numpy.float32)
  return dtype


def master_copy(params: Any) -> Any:
  """``params`` with every leaf in ``master_dtype`` (float32 master weights for bf16 storage).

  An Adam step at lr 1e-6 is far below half a bf16 ulp of a typical weight (~4e-5 at
  |w| = 0.01), so a bf16 parameter updated in place does not move; the optimizer updates this
  copy, and its moments (``zeros_like``) are float32 too. Leaves already in their master dtype
  are returned as they are (no copy). Works on arrays and on ``jax.ShapeDtypeStruct``s."""
  def cast(x):
    dt = master_dtype(x.dtype)
    if dt == x.dtype:
      return x
    if isinstance(x, jax.ShapeDtypeStruct):
      return jax.ShapeDtypeStruct(x.shape, dt, sharding=x.sharding)
    return x.astype(dt)
  return jax.tree.map(cast, params)


def freeze_labels(params: Any, frozen_patterns: Sequence[str]) -> Any:
  """Pytree like ``params`` of 'frozen' / 'trainable' labels.

  A leaf is frozen when any regex in ``frozen_patterns`` matches (``re.search``) its path
  ('layers/0/attn/q_proj/kernel'). Raises ValueError if a pattern matches no parameter (a typo
  would otherwise silently train everything).
  """
  paths = [param_path(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
  for pat in frozen_patterns:
    if not any(re.search(pat, p) for p in paths):
      raise ValueError(f"freeze pattern {pat!r} matched no parameter; parameter paths look like "
                       f"{paths[:3]}. Fix critic.frozen_patterns.")
  return jax.tree_util.tree_map_with_path(
      lambda p, _: "frozen" if any(re.search(pat, param_path(p)) for pat in frozen_patterns)
      else "trainable", params)


def make_optimizer(params: Any, *, lr: float, warmup_steps: int = 0, max_grad_norm: float = 1.0,
                   weight_decay: float = 0.0, b1: float = 0.9, b2: float = 0.999,
                   frozen_patterns: Sequence[str] = (), eps: float = 1e-8
                   ) -> optax.GradientTransformation:
  """AdamW with linear warm-up and global-norm clipping; frozen leaves get ``set_to_zero``.

  Freezing uses ``optax.multi_transform`` so frozen leaves hold no Adam moments (``optax.masked``
  would still allocate them). Gradient clipping sees only the trainable leaves. ``eps`` is
  Adam's denominator epsilon (optax default 1e-8). Wrapped in ``optax.apply_if_finite``: a step
  with non-finite gradients changes nothing.
  """
  if lr <= 0:
    raise ValueError(f"learning rate must be > 0, got {lr}.")
  schedule = (optax.linear_schedule(0.0, lr, warmup_steps) if warmup_steps > 0
              else optax.constant_schedule(lr))
  adam = optax.chain(optax.clip_by_global_norm(max_grad_norm),
                     optax.adamw(schedule, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay))
  if frozen_patterns:
    labels = freeze_labels(params, frozen_patterns)
    adam = optax.multi_transform({"trainable": adam, "frozen": optax.set_to_zero()}, labels)
  # NaN/inf gradients: the update is dropped (params and Adam moments unchanged); the caller
  # stops the run after N such steps in a row (train/resume.py NonFiniteGuard), never this.
  return optax.apply_if_finite(adam, max_consecutive_errors=2**30)
