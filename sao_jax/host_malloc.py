"""glibc malloc settings for XLA:CPU: keep freed memory for reuse instead of unmapping it.

XLA:CPU allocates one temporary buffer for all intermediates of each call of a jitted function
(``compiled.memory_analysis().temp_size_in_bytes``: 54 MB for the tiny DIS policy step of
``benchmarks/bench_train_step.py``, ~490 MB for the small one) and frees it when the call
returns. glibc serves a block that large with a fresh ``mmap`` (above its mmap threshold, at most
32 MiB, and in a thread's arena anything above 64 MiB) and ``munmap``s it on ``free``, so every
step page-faults its whole temp buffer in again: ~12k minor faults and ~16 ms of kernel time per
tiny policy step, about a third of its CPU time on the 2-core benchmark host.

``keep_freed_memory()`` sets, from inside the process, what the environment
``MALLOC_ARENA_MAX=1 MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=2147483647`` sets at start-up:
one malloc arena, no mmap-backed blocks and no trimming of the heap top, so a freed temp buffer
is reused by the next call without faults. Trade-offs: the process's resident memory stays at
its peak instead of shrinking after it (freed memory is reused, not returned to the OS), and
set at run time (not by the environment) the first few calls can still grow the heap by a few
temp buffers (aligned-allocation leftovers) before reuse settles.
"""

from __future__ import annotations

import ctypes
import sys

# <malloc.h> mallopt parameters
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8
_SETTINGS = ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, 2**31 - 1))


def keep_freed_memory() -> bool:
  """Applies the glibc settings above; True if glibc accepted all of them.

  A no-op returning False off Linux/glibc. Call it first thing in the process, before JAX creates
  its CPU client: threads that already own a malloc arena keep it (their blocks above 64 MiB are
  then still mmap-backed).
  """
  if not sys.platform.startswith("linux"):
    return False
  try:
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "gnu_get_libc_version"):  # glibc only, not musl
      return False
    mallopt = libc.mallopt
  except (OSError, AttributeError):
    return False
  mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
  mallopt.restype = ctypes.c_int
  return all([mallopt(param, value) == 1 for param, value in _SETTINGS])
