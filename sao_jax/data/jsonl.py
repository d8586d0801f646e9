"""JSONL loading for problem sets.

Each non-blank line of a problem file is a JSON object with at least the
fields ``id``, ``problem`` and ``answer``, e.g.::

    {"id": "aime-2025-I-01", "problem": "Find the sum ...", "answer": "70"}

Every input error is reported as a ``ValueError`` whose message starts with
``"<path>:<line>: "`` (1-based line numbers), so a broken file can be fixed
without guessing.  Blank (whitespace-only) lines are skipped.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Sequence

_FILES_DIR = Path(__file__).resolve().parent / "files"


@dataclasses.dataclass(frozen=True)
class Problem:
  """One task instance: ``prompt`` is the problem text shown to the policy
  (without any formatting instruction; environments add their own), and
  ``answer`` the gold answer as a string (e.g. ``"70"`` or ``"\\frac{1}{2}"``)."""

  id: str
  prompt: str
  answer: str


def read_jsonl(
    path: str | os.PathLike,
    required: Sequence[str] = ("id", "problem", "answer"),
    blank_lines: str = "skip",
) -> list[dict[str, Any]]:
  """Read a JSONL file into a list of dicts.

  Raises ``ValueError("<path>:<line>: ...")`` for: bytes that are not valid
  UTF-8, invalid JSON, a line that is not a JSON object, and a missing
  required field; with ``blank_lines="error"`` also for an empty line (the
  newline that ends the last line is not an empty line).  A missing file
  raises ``FileNotFoundError``.
  """
  return [row for _, row in _read_jsonl_numbered(Path(path), required, blank_lines)]


def _read_jsonl_numbered(
    path: Path, required: Sequence[str], blank_lines: str = "skip"
) -> list[tuple[int, dict[str, Any]]]:
  if blank_lines not in ("skip", "error"):
    raise ValueError(f"blank_lines must be 'skip' or 'error', got {blank_lines!r}")
  data = path.read_bytes()
  if data.startswith(b"\xef\xbb\xbf"):  # tolerate a UTF-8 byte-order mark
    data = data[3:]
  rows: list[tuple[int, dict[str, Any]]] = []
  lines = data.split(b"\n")
  if lines and lines[-1] == b"":
    lines.pop()  # the final newline
  for lineno, raw in enumerate(lines, start=1):
    try:
      line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
      raise ValueError(
          f"{path}:{lineno}: invalid UTF-8 (byte 0x{raw[e.start]:02x} at column "
          f"{e.start + 1})"
      ) from None
    if not line.strip():
      if blank_lines == "error":
        raise ValueError(
            f"{path}:{lineno}: empty line; remove it (one JSON object per line)")
      continue
    try:
      obj = json.loads(line)
    except json.JSONDecodeError as e:
      raise ValueError(f"{path}:{lineno}: invalid JSON: {e.msg} (column {e.colno})") from None
    if not isinstance(obj, dict):
      raise ValueError(
          f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__}"
      )
    missing = [k for k in required if k not in obj]
    if missing:
      raise ValueError(
          f"{path}:{lineno}: missing required field(s) {missing}; present: {sorted(obj)}"
      )
    rows.append((lineno, obj))
  return rows


def _as_text(value: Any, path: Path, lineno: int, field: str) -> str:
  if isinstance(value, bool) or not isinstance(value, (str, int)):
    raise ValueError(
        f"{path}:{lineno}: field {field!r} must be a string or integer, got "
        f"{type(value).__name__}"
    )
  return str(value)


def load_math_problems(path: str | os.PathLike, blank_lines: str = "skip") -> list[Problem]:
  """Load a ``{"id", "problem", "answer"}`` JSONL file as ``Problem`` objects.

  Integer ``id``/``answer`` values are converted to strings.  Duplicate ids,
  non-string fields and empty ``id``/``problem``/``answer`` raise
  ``ValueError`` with file and line number (``blank_lines`` as in
  ``read_jsonl``).
  """
  path = Path(path)
  rows = _read_jsonl_numbered(path, ("id", "problem", "answer"), blank_lines)
  problems: list[Problem] = []
  seen: dict[str, int] = {}
  for lineno, row in rows:
    pid = _as_text(row["id"], path, lineno, "id")
    if not isinstance(row["problem"], str):
      raise ValueError(
          f"{path}:{lineno}: field 'problem' must be a string, got "
          f"{type(row['problem']).__name__}"
      )
    answer = _as_text(row["answer"], path, lineno, "answer").strip()
    for field, value in (("id", pid), ("problem", row["problem"]), ("answer", answer)):
      if not value.strip():
        raise ValueError(f"{path}:{lineno}: field {field!r} is empty; give it a value")
    if pid in seen:
      raise ValueError(f"{path}:{lineno}: duplicate id {pid!r} (first on line {seen[pid]})")
    seen[pid] = lineno
    problems.append(Problem(id=pid, prompt=row["problem"], answer=answer))
  return problems


def packaged_path(name: str) -> str:
  """Absolute path of a data file shipped in ``sao_jax/data/files``.

  ``packaged_path("aime25.jsonl")``.  Raises ``FileNotFoundError`` if absent.
  """
  if not name or Path(name).name != name or name in (".", ".."):
    raise ValueError(f"packaged_path expects a bare file name, got {name!r}")
  p = _FILES_DIR / name
  if not p.is_file():
    available = sorted(f.name for f in _FILES_DIR.iterdir()) if _FILES_DIR.is_dir() else []
    raise FileNotFoundError(
        f"no packaged data file {name!r} in {_FILES_DIR}; available: {available}")
  return str(p)
