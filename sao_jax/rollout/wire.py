"""How trajectories (with per-token log-probs and versions) and weights travel between processes.

JetStream 0.2.2's ``Orchestrator.Decode`` protocol returns token ids and text only -- no
log-probs, no policy versions, no multi-turn observations. Rather than fork its ``.proto``, the
inference host serves a second, sao_jax-owned gRPC service next to JetStream's:

  service ``sao_jax.RolloutHost`` (no ``.proto`` file: grpc generic handlers + msgpack bodies)
    ``Take({max_items, timeout_s}) -> {items: [Trajectory, ...], version, instance}``  up to
        ``max_items`` finished RL trajectories (pull-based: the trainer asks for as many as its
        bounded queue has room for, so nothing piles up in gRPC's flow-control window), each
        with per-token ``tokens`` int32 [L], ``action_mask`` float32 [L], ``logprobs`` float32 [L]
        (the engine's log-prob of each sampled token; 0 off actions) and ``policy_version``
        int32 [L] (-1 off actions), plus reward, turns, truncation, info, host and timestamps;
        ``version`` is the host's current weights version and ``instance`` a random id drawn at
        host start (a changed id = the host restarted and lost its weights);
    ``PublishWeights(Weights) -> {version, instance}``  the trainer's ``(params, version)``
        (ignored unless newer than the host's version);
    ``Status(Empty) -> Status``  version, instance, counters, queue size.

Message bodies are msgpack (``flax.serialization.msgpack_serialize``: numpy arrays travel as raw
little-endian buffers with dtype and shape, so float32 log-probs arrive bit-exact). Params travel
as the list of leaves in ``jax.tree.leaves`` order; the receiver rebuilds the tree from its own
model's structure and checks every shape and dtype. The same encoding is used for the shared
checkpoint path (``write_weights`` / ``read_latest_weights``): one ``v{version:08d}.msgpack``
file per version, written to a temporary name and renamed (atomic on POSIX), then ``LATEST``.
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional

import jax
import numpy as np
from flax import serialization

from sao_jax.rollout.trajectory import Trajectory

SERVICE = "sao_jax.RolloutHost"
MAX_MESSAGE_BYTES = 1 << 30  # gRPC default is 4 MiB; weights need more
GRPC_OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]


def pack(obj: Any) -> bytes:
  """msgpack bytes of a dict/list tree of numpy arrays, numbers and strings."""
  return serialization.msgpack_serialize(obj)


def unpack(data: bytes) -> Any:
  return serialization.msgpack_restore(data)


def trajectory_to_dict(t: Trajectory, host: str = "") -> dict:
  return {"problem_id": t.problem_id, "tokens": np.asarray(t.tokens, np.int32),
          "action_mask": np.asarray(t.action_mask, np.float32),
          "logprobs": np.asarray(t.logprobs, np.float32),
          "policy_version": np.asarray(t.policy_version, np.int32), "reward": float(t.reward),
          "num_turns": int(t.num_turns), "truncated": bool(t.truncated),
          "info": json.dumps(t.info, default=str), "t_start": float(t.t_start),
          "t_end": float(t.t_end), "host": host}


def trajectory_from_dict(d: dict) -> Trajectory:
  """Inverse of ``trajectory_to_dict``; the host name lands in ``info["host"]``."""
  info = json.loads(d["info"])
  info["host"] = d.get("host", "")
  return Trajectory(problem_id=d["problem_id"], tokens=np.asarray(d["tokens"], np.int32),
                    action_mask=np.asarray(d["action_mask"], np.float32),
                    logprobs=np.asarray(d["logprobs"], np.float32),
                    policy_version=np.asarray(d["policy_version"], np.int32),
                    reward=float(d["reward"]), num_turns=int(d["num_turns"]),
                    truncated=bool(d["truncated"]), info=info, t_start=float(d["t_start"]),
                    t_end=float(d["t_end"]))


def params_to_bytes(params: Any, version: int) -> bytes:
  """Weights message: ``{"version": int, "leaves": [np.ndarray, ...]}`` (tree-leaves order)."""
  leaves = [np.asarray(x) for x in jax.tree.leaves(params)]
  return pack({"version": int(version), "leaves": {str(i): x for i, x in enumerate(leaves)}})


def params_from_bytes(data: bytes, like: Any) -> tuple[Any, int]:
  """Rebuilds params shaped like ``like`` (same tree). Returns (params as numpy, version).

  Raises ValueError naming the first leaf whose shape or dtype differs (e.g. a host started with
  another model config than the trainer)."""
  msg = unpack(data)
  leaves = [msg["leaves"][str(i)] for i in range(len(msg["leaves"]))]
  ref, treedef = jax.tree.flatten(like)
  if len(leaves) != len(ref):
    raise ValueError(f"weights carry {len(leaves)} arrays, this model has {len(ref)}: the host "
                     "and the trainer must use the same model config.")
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(like)[0]]
  for path, a, r in zip(paths, leaves, ref):
    if a.shape != np.shape(r) or a.dtype != np.asarray(r).dtype:
      raise ValueError(f"weights leaf {path}: got {a.shape} {a.dtype}, this model has "
                       f"{np.shape(r)} {np.asarray(r).dtype}; use the same model config.")
  return jax.tree.unflatten(treedef, leaves), int(msg["version"])


def write_weights(directory: str, params: Any, version: int, keep: int = 2) -> str:
  """Writes ``directory/v{version:08d}.msgpack`` atomically, then points ``LATEST`` at it;
  deletes all but the newest ``keep`` version files. Returns the file path."""
  os.makedirs(directory, exist_ok=True)
  name = f"v{version:08d}.msgpack"
  path = os.path.join(directory, name)
  tmp = path + f".tmp{os.getpid()}"
  with open(tmp, "wb") as f:
    f.write(params_to_bytes(params, version))
  os.replace(tmp, path)
  tmp_latest = os.path.join(directory, f"LATEST.tmp{os.getpid()}")
  with open(tmp_latest, "w", encoding="utf-8") as f:
    f.write(name)
  os.replace(tmp_latest, os.path.join(directory, "LATEST"))
  old = sorted(n for n in os.listdir(directory) if n.startswith("v") and n.endswith(".msgpack"))
  for n in old[:-keep]:
    try:
      os.remove(os.path.join(directory, n))
    except FileNotFoundError:
      pass
  return path


def read_latest_weights(directory: str, like: Any,
                        newer_than: int = -1) -> Optional[tuple[Any, int]]:
  """Returns (params, version) of ``directory/LATEST`` if its version > ``newer_than``, else
  None (also None when nothing was written yet)."""
  try:
    with open(os.path.join(directory, "LATEST"), encoding="utf-8") as f:
      name = f.read().strip()
  except FileNotFoundError:
    return None
  if not name or int(name[1:9]) <= newer_than:
    return None
  try:
    with open(os.path.join(directory, name), "rb") as f:
      return params_from_bytes(f.read(), like)
  except FileNotFoundError:  # pruned between the two reads: the next poll sees a newer LATEST
    return None
