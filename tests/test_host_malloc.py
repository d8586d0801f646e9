"""sao_jax.host_malloc: glibc accepts the settings; a jitted step then reuses its temp buffer."""

import subprocess
import sys

import pytest

SCRIPT = r"""
import resource
from sao_jax import host_malloc
print(host_malloc.keep_freed_memory())
import jax, jax.numpy as jnp
f = jax.jit(lambda x: jnp.sum(jnp.sin(x[:, None] * x[None, :]) ** 2))  # 64 MiB temp
x = jnp.linspace(0, 1, 4096)
for _ in range(20):  # the first calls may still grow the heap (alignment leftovers)
  f(x).block_until_ready()
r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
  f(x).block_until_ready()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0) // 10)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")
def test_keep_freed_memory_stops_per_call_page_faults():
  out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                       check=True).stdout.split()
  assert out[0] == "True"
  assert int(out[1]) < 1000, out  # glibc defaults: the 64 MiB re-faulted per call, ~16k faults
