"""Progress display for long work: a tqdm bar on a terminal, plain lines otherwise.

On a TTY the bar shows steps done / total, rate, ETA and the latest reward, staleness and
rollout count as its postfix; other output (the per-step metric lines) goes through
``tqdm.write`` so it scrolls above the bar instead of breaking it. When the stream is not a TTY
(a log file, CI, a notebook, ``| tee``) there is no carriage-return animation: one plain status
line is printed at most every ``min_interval_s`` seconds and always for the last step.
"""

from __future__ import annotations

import sys
import time
from typing import Optional, TextIO

from tqdm import tqdm

MODES = ("auto", "bar", "lines", "off")


def format_fields(fields: dict) -> str:
  """``{"reward": 0.41, "staleness": 1.25}`` -> ``"reward 0.41  staleness 1.25"`` (4 significant
  digits for floats; other values with ``str``; None values are skipped)."""
  parts = []
  for k, v in fields.items():
    if v is None:
      continue
    parts.append(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}")
  return "  ".join(parts)


def format_status(desc: str, done: int, total: int, elapsed_s: float, fields: dict,
                  since: tuple[int, float] = (0, 0.0)) -> str:
  """One plain status line.

  ETA is the rate since ``since = (done_then, elapsed_then)`` times the units left:
  ``(elapsed_s - elapsed_then) / (done - done_then) * (total - done)`` (seconds, formatted
  ``[H:]MM:SS`` by tqdm), "?" while ``done <= done_then``. ``Progress`` measures from its first
  unit, whose time includes the JIT compile. Example:
  ``format_status("SAO", 25, 100, 50.0, {"reward": 0.5})`` ->
  ``"SAO 25/100 (25%) elapsed 00:50 ETA 02:30 | reward 0.5"``.
  """
  pct = 100.0 * done / total if total else 100.0
  d0, e0 = since
  eta = (tqdm.format_interval((elapsed_s - e0) / (done - d0) * (total - done))
         if done > d0 else "?")
  line = (f"{desc} {done}/{total} ({pct:.0f}%) elapsed {tqdm.format_interval(elapsed_s)} "
          f"ETA {eta}")
  shown = format_fields(fields)
  return f"{line} | {shown}" if shown else line


class _BarSafeStream:
  """File-like object whose complete lines are written with ``tqdm.write`` (keeps a bar intact)."""

  def __init__(self, stream: TextIO):
    self._stream, self._buf = stream, ""

  def write(self, text: str) -> int:
    self._buf += text
    while "\n" in self._buf:
      line, self._buf = self._buf.split("\n", 1)
      tqdm.write(line, file=self._stream)
    return len(text)

  def flush(self) -> None:
    self._stream.flush()

  def isatty(self) -> bool:
    return False


class Progress:
  """Progress over ``total`` units of work.

  Args:
    total: number of updates expected (e.g. policy steps), > 0.
    desc: label shown first.
    mode: "auto" (bar on a TTY, lines otherwise), "bar", "lines" or "off".
    stream: where to write (default ``sys.stdout``).
    min_interval_s: lines mode: least seconds between two status lines.
    clock: time source in seconds (tests pass a fake one).

  Raises ValueError for an unknown ``mode`` or ``total < 1``.
  Use ``stream`` (the attribute) for any other printing while the bar is shown.
  """

  def __init__(self, total: int, desc: str = "progress", mode: str = "auto",
               stream: Optional[TextIO] = None, min_interval_s: float = 10.0, clock=time.time):
    if mode not in MODES:
      raise ValueError(f"log.progress={mode!r}; use one of {MODES}.")
    if total < 1:
      raise ValueError(f"progress total must be >= 1, got {total}.")
    out = stream or sys.stdout
    if mode == "auto":
      mode = "bar" if getattr(out, "isatty", lambda: False)() else "lines"
    self.mode, self.total, self.desc = mode, total, desc
    self.min_interval_s, self._clock = min_interval_s, clock
    self._out = out
    self.done = 0
    self._t0 = clock()
    self._last_line = -float("inf")
    self._since: Optional[tuple[int, float]] = None  # (done, elapsed) after the first update
    self._bar = None
    self.stream: TextIO = out
    if mode == "bar":
      self._bar = tqdm(total=total, desc=desc, file=out, dynamic_ncols=True, unit="step",
                       leave=True)
      self.stream = _BarSafeStream(out)

  def update(self, n: int = 1, **fields) -> None:
    """Marks ``n`` more units done and shows ``fields`` (e.g. reward=0.4, staleness=1.2)."""
    self.done += n
    if self._bar is not None:
      self._bar.set_postfix_str(format_fields(fields), refresh=False)
      self._bar.update(n)
      return
    if self.mode != "lines":
      return
    now = self._clock()
    if self._since is None:  # the first unit holds the compile: the ETA's rate starts after it
      self._since = (self.done, now - self._t0)
    if self.done >= self.total or now - self._last_line >= self.min_interval_s:
      self._last_line = now
      print(format_status(self.desc, self.done, self.total, now - self._t0, fields,
                          since=self._since), file=self._out, flush=True)

  def close(self) -> None:
    if self._bar is not None:
      self._bar.close()
      self._bar = None
