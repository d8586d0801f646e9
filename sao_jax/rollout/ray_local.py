"""A local Ray that listens on loopback only (the cluster the driver starts when
``rollout.ray_address`` is empty).

On Linux, Ray 2.60 gives a local cluster the machine's external IP as its node IP, and its
processes (GCS, raylet node and object managers, the core worker of the driver and of every
worker, the agents) then listen on every interface (``::`` / ``0.0.0.0``) or on that IP.
``ray.init(_node_ip_address="127.0.0.1")`` does not help: Ray replaces a loopback node IP by the
external one. Ray's own switch for macOS / Windows, where a local Ray is loopback-only by
default, does: with ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` the node IP is 127.0.0.1 and each of
those processes binds 127.0.0.1 (``tests/integration/test_resume.py::
test_killed_async_run_resumes_and_consumes_every_prompt_once[ray]`` lists them). The
``jax.experimental.transfer`` servers of the weight sync bind the node IP
(``weight_sync.node_ip``), so they are on loopback too.

Ray 2.60 also turns its token authentication on for a local cluster (a token in
``~/.ray/auth_token``, written on first use): other users of the machine who reach the loopback
ports still need the token.
"""

from __future__ import annotations

import ipaddress
import os
import sys

_SWITCH = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # ray._private.ray_constants.ENABLE_RAY_CLUSTER


def is_loopback(host: str) -> bool:
  """True for "localhost", 127.0.0.0/8 and ::1 (brackets and an IPv4-mapped form accepted)."""
  host = host.strip("[]")
  if host == "localhost":
    return True
  try:
    ip = ipaddress.ip_address(host)
  except ValueError:
    return False
  mapped = getattr(ip, "ipv4_mapped", None)
  return (mapped or ip).is_loopback


def init_ray(address: str = "", **kwargs) -> str:
  """``ray.init`` that keeps a one-machine Ray on loopback. Returns this node's IP as Ray sees it.

  * ``address`` "" and no ``RAY_ADDRESS`` in the environment (a laptop run): starts a new
    local cluster whose processes listen on 127.0.0.1 only (``include_dashboard`` defaults to
    False);
  * a loopback ``address`` ("127.0.0.1:port", "localhost:port": such a cluster, e.g. a test's):
    joins it -- a plain ``ray.init`` would replace the loopback host by the external IP and
    never reach it;
  * any other address (a cluster): a plain ``ray.init(address=...)``; its ports and access are
    the cluster's own (README, "More than one machine").

  The first two set Ray's ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` switch (and the constant Ray
  read from it when it was imported) while ``ray.init`` runs -- the processes it starts inherit
  it -- and restore both afterwards. If this Ray version still picks another node IP for a new
  cluster, a warning line says so."""
  import ray  # pylint: disable=import-outside-toplevel  (optional: only the ray backend)
  address = address or os.environ.get("RAY_ADDRESS", "")  # ray.init's own fallback
  if address and not is_loopback(address.rpartition(":")[0] or address):
    ray.init(address=address, **kwargs)
    return ray.util.get_node_ip_address()
  if not address:
    kwargs.setdefault("include_dashboard", False)
  try:
    from ray._private import ray_constants  # pylint: disable=import-outside-toplevel
  except ImportError:  # a Ray without the module: the environment variable alone
    ray_constants = None
  old_env = os.environ.get(_SWITCH)
  old_const = getattr(ray_constants, "ENABLE_RAY_CLUSTER", None)
  os.environ[_SWITCH] = "0"
  if old_const is not None:
    ray_constants.ENABLE_RAY_CLUSTER = False
  try:
    ray.init(address=address or None, **kwargs)
  finally:
    if old_env is None:
      os.environ.pop(_SWITCH, None)
    else:
      os.environ[_SWITCH] = old_env
    if old_const is not None:
      ray_constants.ENABLE_RAY_CLUSTER = old_const
  ip = ray.util.get_node_ip_address()
  if not is_loopback(ip):
    print(f"warning: the local Ray listens on {ip}, not on loopback (Ray {ray.__version__} "
          f"ignored {_SWITCH}=0); its ports are reachable from the network, guarded by Ray's "
          "token authentication only if RAY_AUTH_MODE=token.", file=sys.stderr, flush=True)
  return ip
