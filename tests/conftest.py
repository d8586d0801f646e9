"""Test-session settings, set here before JAX starts; subprocesses inherit them through the
environment (``with_test_xla_flags`` for those that set their own ``XLA_FLAGS``). Runs outside
the tests keep JAX's and XLA's defaults.

* XLA:CPU compiles the suite's many small programs at backend optimization level 0 (about 40%
  less compile time, e.g. a tiny MoE learner's first step 6.7 s -> 3.9 s; the numbers tested are
  unchanged, e.g. SmolLM2's float32 parity 8.9e-5 either way).
* One persistent compilation cache for the session (``JAX_COMPILATION_CACHE_DIR``: a fresh
  temporary directory, removed at the end; an existing setting is kept): most of the suite's time
  is XLA compiling, and many tests and runs compile the same programs again (every arm of an
  experiment's quick run, every mode's critic, a resumed run). Entries are keyed by the program,
  the devices, jax/XLA's versions and the flags, so an entry is only reused for the same program.
  No size limit: a limit turns on JAX's LRU eviction, which takes a file lock and lists and
  stats every entry on each write (``jax/_src/lru_cache.py``), and with the thousands of small
  programs of this suite that serialised the xdist workers and their subprocesses on the lock
  (the full suite took 38 min with it, 2026-12-04). Without eviction a write is one file; a
  reader that meets a half-written entry gets a read error, which JAX reports and then compiles.
"""

import atexit
import os
import shutil
import sys
import tempfile

# Test files live in tests/unit/<layer>/ and tests/integration/; their shared helpers
# (repo_paths, oracles, fixtures, subprocess workers) stay in tests/ and are imported from here.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

TEST_XLA_FLAG = "--xla_backend_optimization_level=0"


def with_test_xla_flags(flags: str) -> str:
  """``flags`` plus the suite's optimization-level flag."""
  return f"{flags} {TEST_XLA_FLAG}".strip() if TEST_XLA_FLAG not in flags else flags


os.environ["XLA_FLAGS"] = with_test_xla_flags(os.environ.get("XLA_FLAGS", ""))

if "JAX_COMPILATION_CACHE_DIR" not in os.environ:  # the first process of the session makes it
  _CACHE = tempfile.mkdtemp(prefix="sao_jax_test_xla_cache_")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE
  atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")  # every program
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
