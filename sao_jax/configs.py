"""The repository's config files, ``configs/<name>.py``, by name.

For configs that derive from another one (``configs/aime.py`` starts from ``arith_tool``) and for
tests and benchmarks; every field's default is declared in ``sao_jax/roles.py``. Raises
FileNotFoundError naming the file when there is no such config.
"""

from __future__ import annotations

import importlib.util
import os
import types

import ml_collections

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_module(name: str) -> types.ModuleType:
  """The module ``configs/<name>.py`` (executed)."""
  path = os.path.join(ROOT, "configs", f"{name}.py")
  if not os.path.isfile(path):
    raise FileNotFoundError(f"no config file {path}; the configs are "
                            f"{sorted(f[:-3] for f in os.listdir(os.path.dirname(path)))}.")
  spec = importlib.util.spec_from_file_location(f"sao_configs_{name}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def load(name: str, variant: str = "") -> ml_collections.ConfigDict:
  """``configs/<name>.py``'s ``get_config(variant)``."""
  return load_module(name).get_config(variant)
