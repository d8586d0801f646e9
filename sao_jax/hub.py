"""Hugging Face hub ids as ``model.checkpoint_dir``: ``Qwen/Qwen3-0.6B`` instead of a folder.

A value that is not an existing path and reads as ``owner/name`` is a hub id: it is resolved with
``huggingface_hub.snapshot_download`` into the hub cache (``HF_HOME`` / ``HF_HUB_CACHE``; default
``~/.cache/huggingface/hub``), which returns the snapshot folder (``config.json``,
``*.safetensors``, ``tokenizer.json``, ...) that the Hugging Face loader reads. With
``HF_HUB_OFFLINE=1``, or when the hub cannot be reached, the cached snapshot is read and nothing
is downloaded. Only the files the loader reads are fetched (``HUB_FILES``; no ``*.bin``/``*.pt``).
"""

from __future__ import annotations

import functools
import os
import re

# what models/hf.py and data/hf_tokenizer.py read from a checkpoint folder
HUB_FILES = ("*.json", "*.safetensors", "*.jinja")

_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


def is_hub_id(value: str) -> bool:
  """True when ``value`` names a hub model (``owner/name``) rather than a local path: it is not an
  existing path, does not start with ``.``, ``/`` or ``~``, and has exactly one ``/``."""
  return bool(value) and not os.path.exists(value) and _HUB_ID.match(value) is not None


@functools.lru_cache(maxsize=None)
def resolve_checkpoint_dir(value: str, cache_dir: str | None = None,
                           field: str = "model.checkpoint_dir") -> str:
  """The local folder for ``field``'s ``value``: ``value`` itself unless it is a hub id
  (``is_hub_id``), else the hub snapshot folder in ``cache_dir`` (None: the hub's cache,
  ``HF_HUB_CACHE``), downloaded there first when not cached and the hub is reachable.

  Raises FileNotFoundError naming ``field`` when the id is neither a folder nor in the cache and
  cannot be downloaded (offline: ``HF_HUB_OFFLINE=1``, no network, an unknown or gated repo)."""
  if not is_hub_id(value):
    return value
  import huggingface_hub  # pylint: disable=import-outside-toplevel  (only for hub ids)
  from huggingface_hub import constants  # pylint: disable=import-outside-toplevel
  try:
    return huggingface_hub.snapshot_download(repo_id=value, cache_dir=cache_dir,
                                             allow_patterns=list(HUB_FILES))
  except Exception as e:  # pylint: disable=broad-except  (hub errors vary by cause; all say the same to the user)
    where = cache_dir or constants.HF_HUB_CACHE
    offline = " (HF_HUB_OFFLINE=1)" if constants.HF_HUB_OFFLINE else ""
    raise FileNotFoundError(
        f"config.{field} = {value!r}: not a folder, and as a Hugging Face hub id not in the cache "
        f"{where}{offline} nor downloadable ({type(e).__name__}: {str(e).splitlines()[0]}); fix: "
        f"give a local checkpoint folder, or download it once with network access "
        f"(`hf download {value}`, or a run without HF_HUB_OFFLINE), or point "
        "HF_HOME / HF_HUB_CACHE at the cache that holds it.") from e
