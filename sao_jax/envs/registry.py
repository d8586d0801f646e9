"""The task registry: ``task.name`` -> ``"module:function"`` building it.

A new task is one module with a ``build_task(run: roles.Run, tokenizer) -> tasks.Task``
function and one line here (docs/extending.md). ``roles.Task.name``'s allowed values are these
keys, so validation and docs/config.md follow this table.
"""

from __future__ import annotations

import importlib

TASKS: dict[str, object] = {  # name -> "module:function" (or the function itself)
    "arith_tool": "sao_jax.tasks:build_arith_tool",
    "chain_tool": "sao_jax.tasks:build_chain_tool",
    "math": "sao_jax.tasks:build_math",
    "style_switch": "sao_jax.tasks:build_style_switch",
    "tir_math": "sao_jax.tasks:build_tir_math",
    "chat_arith": "sao_jax.tasks:build_chat_arith",
    "swe_lite": "sao_jax.envs.swe_lite:build_task",
    "swe": "sao_jax.envs.swe_lite:build_swe_task",
}


def builder(name: str):
  """The function registered for task ``name``. Raises ValueError naming the known tasks."""
  if name not in TASKS:
    raise ValueError(f"unknown task.name={name!r}; use one of {tuple(TASKS)} "
                     "(sao_jax/envs/registry.py:TASKS)")
  entry = TASKS[name]
  if callable(entry):  # registered at run time (a notebook, docs/extending.md's example)
    return entry
  module, fn = entry.split(":")
  return getattr(importlib.import_module(module), fn)
