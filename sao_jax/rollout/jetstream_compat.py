"""The one place where sao_jax imports google-jetstream 0.2.2 (its Engine API).

``SAOEngine`` implements JetStream's ``engine_api.Engine``; sao_jax uses JetStream's engine and
tokenizer API only (not its orchestrator or gRPC server). Two facts about JetStream 0.2.2 are
handled here and nowhere else:

1. ``jetstream.engine.token_utils`` (imported by ``engine_api``) imports ``seqio`` at import time
   for its SentencePiece tokenizer, and JetStream's pip metadata pulls ``seqio`` and with it
   TensorFlow (several GB). sao_jax never uses SentencePiece through JetStream: ``install.sh``
   installs JetStream with ``pip install --no-deps`` (``requirements-nodeps.txt``) and, when
   ``seqio`` is not importable, this module registers a stub ``seqio.vocabularies`` module whose
   two classes raise if ever instantiated. A real ``seqio``, when installed, is used untouched.
2. Because of 1, ``pyproject.toml`` cannot list JetStream, so a plain ``pip install -e .`` has no
   JetStream. Then this module defines the API's base classes itself (``_Fallback*`` below:
   ``engine_api.Engine`` with the same abstract methods, ``ResultTokens`` / ``SlotData`` with the
   same fields, ``tokenizer_api.Tokenizer``, ``tokenizer_pb2.TokenizerParameters``) so the engine
   and the main job work; ``tests/unit/rollout/test_engine.py`` checks them against JetStream's
   (names,
   fields, abstract methods) whenever JetStream is installed. ``HAVE_JETSTREAM`` says which.
   Code that needs JetStream itself (its orchestrator) installs it: ``JETSTREAM_INSTALL``.

Import JetStream only through this module:
``from sao_jax.rollout.jetstream_compat import engine_api``.
"""

import abc
import importlib.util
import sys
import types
from typing import Any, Union

import jax
import numpy as np
from flax import struct

JETSTREAM_INSTALL = "pip install --no-deps google-jetstream==0.2.2"


def _install_seqio_stub() -> None:
  if "seqio" in sys.modules or importlib.util.find_spec("seqio") is not None:
    return

  class Vocabulary:  # pylint: disable=too-few-public-methods
    """Stand-in for seqio.vocabularies.Vocabulary (seqio is not installed)."""

    def __init__(self, *args, **kwargs):
      raise ImportError(
          "JetStream's SentencePiece tokenizer needs `seqio`, which sao_jax does not install. "
          "Use the engine's own tokenizer (SAOEngine.build_tokenizer) or `pip install seqio`.")

  class SentencePieceVocabulary(Vocabulary):
    """Stand-in for seqio.vocabularies.SentencePieceVocabulary."""

  seqio = types.ModuleType("seqio")
  vocabularies = types.ModuleType("seqio.vocabularies")
  vocabularies.Vocabulary = Vocabulary
  vocabularies.SentencePieceVocabulary = SentencePieceVocabulary
  seqio.vocabularies = vocabularies
  sys.modules["seqio"] = seqio
  sys.modules["seqio.vocabularies"] = vocabularies


def _fallback_modules():
  """The three JetStream 0.2.2 API modules' names, defined here (JetStream not installed)."""

  @struct.dataclass
  class SlotData:
    """JetStream's ``engine_api.SlotData``: one slot's tokens, validity and lengths."""
    tokens: Union[jax.Array, np.ndarray]
    valid: Union[jax.Array, np.ndarray]
    lengths: Union[jax.Array, np.ndarray]

  @struct.dataclass
  class ResultTokens(abc.ABC):
    """JetStream's ``engine_api.ResultTokens``: ``data [batch, n]`` holds tokens, validity and
    lengths side by side; the ``*_idx`` ranges say which columns are which."""
    data: Union[jax.Array, np.ndarray]
    tokens_idx: tuple = struct.field(pytree_node=False)
    valid_idx: tuple = struct.field(pytree_node=False)
    length_idx: tuple = struct.field(pytree_node=False)
    samples_per_slot: int = struct.field(pytree_node=False)

    def copy_to_host_async(self) -> None:
      if not isinstance(self.data, np.ndarray):
        self.data.copy_to_host_async()

    def convert_to_numpy(self):
      return ResultTokens(np.array(self.data), self.tokens_idx, self.valid_idx, self.length_idx,
                          self.samples_per_slot)

    def get_result_at_slot(self, slot: int) -> SlotData:
      lo, hi = slot * self.samples_per_slot, (slot + 1) * self.samples_per_slot
      return SlotData(tokens=self.data[lo:hi, self.tokens_idx[0]:self.tokens_idx[1]],
                      valid=self.data[lo:hi, self.valid_idx[0]:self.valid_idx[1]],
                      lengths=self.data[lo:hi, self.length_idx[0]:self.length_idx[1]][:, 0])

  def abstract(*names):
    return {n: abc.abstractmethod(lambda self, *a, **k: None) for n in names}

  Engine = abc.ABCMeta("Engine", (abc.ABC,), {
      "__doc__": "JetStream's ``engine_api.Engine``: the methods an engine implements.",
      **abstract("prefill", "generate", "insert", "load_params",
                 "get_prefix_destination_sharding", "get_tokenizer", "init_decode_state",
                 "max_concurrent_decodes", "samples_per_slot", "max_prefill_length", "mesh",
                 "colocated_cpus")})
  Tokenizer = abc.ABCMeta("Tokenizer", (abc.ABC,), {
      "__doc__": "JetStream's ``tokenizer_api.Tokenizer``.",
      **abstract("encode", "decode", "pad_id", "eos_id", "bos_id")})

  @struct.dataclass
  class TokenizerParameters:
    """JetStream's ``tokenizer_pb2.TokenizerParameters`` (a proto there; its two fields here)."""
    path: str = ""
    extra_ids: int = 0

  def module(name, **members):
    m = types.ModuleType(name)
    m.__dict__.update(members)
    return m
  return (module("engine_api", Engine=Engine, ResultTokens=ResultTokens, SlotData=SlotData),
          module("tokenizer_api", Tokenizer=Tokenizer),
          module("tokenizer_pb2", TokenizerParameters=TokenizerParameters))


HAVE_JETSTREAM = importlib.util.find_spec("jetstream") is not None
engine_api: Any
tokenizer_api: Any
tokenizer_pb2: Any
if HAVE_JETSTREAM:
  _install_seqio_stub()
  from jetstream.engine import engine_api, tokenizer_api, tokenizer_pb2  # noqa: E402
else:
  engine_api, tokenizer_api, tokenizer_pb2 = _fallback_modules()

__all__ = ["engine_api", "tokenizer_api", "tokenizer_pb2", "HAVE_JETSTREAM", "JETSTREAM_INSTALL"]
