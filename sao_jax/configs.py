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


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parser for the command lines (``app.run(main, flags_parser=parse_flags)``),
  with a ``--config.<path>=...`` override of a field the config does not have reported as one
  line naming it (ml_collections raises a bare ``AttributeError`` while the flags are parsed,
  before ``main`` runs): ``SystemExit`` (status 1) with the field and the fix."""
  from absl import app  # pylint: disable=import-outside-toplevel
  try:
    return app.parse_flags_with_usage(argv)
  except (AttributeError, KeyError) as e:
    msg = e
    while isinstance(msg, BaseException):  # AttributeError(KeyError("'x'\nDid you mean ..."))
      msg = msg.args[0] if msg.args else ""
    first, _, hint = str(msg).partition("\n")
    name = first.strip("'\"")
    paths = [a.split("=", 1)[0].lstrip("-").split(".") for a in argv if a.startswith("--config.")]
    field = next((".".join(p[:p.index(name) + 1]) for p in paths if name in p[1:]),
                 f"config.<...>.{name}")
    raise SystemExit(f"{field}: unknown field{' (' + hint.strip() + ')' if hint else ''}; fix: "
                     "use a field listed in docs/config.md (a new field is declared in "
                     "sao_jax/roles.py).") from None
