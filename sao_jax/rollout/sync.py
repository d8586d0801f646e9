"""Trainer -> engine weight sync and the bounded trajectory queue."""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Optional


class WeightStore:
  """Holds the newest ``(params, policy_version)`` published by the trainer.

  The trainer calls ``publish`` after each policy update; rollout workers call ``latest_if_newer``
  between generate steps, so a trajectory can span several versions (recorded per token).
  Versions must increase strictly (ValueError otherwise). Thread-safe.
  """

  def __init__(self, params: Any, version: int = 0):
    self._lock = threading.Lock()
    self._params, self._version = params, version

  def publish(self, params: Any, version: int) -> None:
    with self._lock:
      if version <= self._version:
        raise ValueError(f"policy_version must increase: got {version} after {self._version}.")
      self._params, self._version = params, version

  @property
  def version(self) -> int:
    with self._lock:
      return self._version

  def latest(self) -> tuple[Any, int]:
    with self._lock:
      return self._params, self._version

  def latest_if_newer(self, version: int) -> Optional[tuple[Any, int]]:
    with self._lock:
      if self._version > version:
        return self._params, self._version
      return None


class TrajectoryQueue:
  """Bounded FIFO between rollout workers and the trainer (backpressure when full).

  ``put`` blocks while the queue is full, waking every ``poll_s`` to honour ``stop``;
  ``get`` blocks until an item arrives or ``timeout`` seconds pass (then raises ``queue.Empty``).
  Counts items put and records each item's enqueue time (for queue-age metrics).
  """

  def __init__(self, maxsize: int, poll_s: float = 0.05):
    if maxsize < 1:
      raise ValueError(f"rollout.queue_size must be >= 1, got {maxsize}.")
    self._q: queue.Queue = queue.Queue(maxsize)
    self.poll_s = poll_s
    self.num_put = 0
    self.max_seen = 0

  def put(self, item: Any, stop: Optional[threading.Event] = None) -> bool:
    """Returns False if ``stop`` was set before the item could be enqueued."""
    while True:
      try:
        self._q.put((time.time(), item), timeout=self.poll_s)
        self.num_put += 1
        self.max_seen = max(self.max_seen, self._q.qsize())
        return True
      except queue.Full:
        if stop is not None and stop.is_set():
          return False

  def get(self, timeout: Optional[float] = None) -> tuple[Any, float]:
    """Returns (item, seconds it waited in the queue)."""
    t_put, item = self._q.get(timeout=timeout)
    return item, time.time() - t_put

  def get_nowait(self) -> tuple[Any, float]:
    """Like ``get`` without waiting (raises ``queue.Empty``)."""
    t_put, item = self._q.get_nowait()
    return item, time.time() - t_put

  def qsize(self) -> int:
    return self._q.qsize()

  @property
  def maxsize(self) -> int:
    return self._q.maxsize
