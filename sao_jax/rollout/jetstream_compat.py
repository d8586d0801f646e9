"""The one place where sao_jax adapts google-jetstream 0.2.2 to this environment.

JetStream 0.2.2 has two problems with a current, lean JAX install, both handled here and nowhere
else:

1. ``jetstream.engine.token_utils`` (imported by ``engine_api``) imports ``seqio`` at import time
   for its SentencePiece tokenizer, and JetStream's pip metadata pulls ``seqio`` and with it
   TensorFlow (several GB). sao_jax never uses SentencePiece through JetStream: it installs
   JetStream with ``pip install --no-deps`` (see ``requirements-nodeps.txt``) and, when ``seqio`` is
   not importable, registers a stub ``seqio.vocabularies`` module whose two classes raise if ever
   instantiated. A real ``seqio``, when installed, is used untouched.
2. JetStream's orchestrator calls ``jax.tree_map``, which current JAX removed; the orchestrator's
   Driver thread then dies. ``jax.tree_map`` is aliased to ``jax.tree.map`` when missing.
3. ``jetstream.core.orchestrator`` sets the *root* logger to DEBUG and adds a stdout handler at
   import time (every generate step is then logged). ``server_lib()`` / ``orchestrator()`` import
   it lazily (only the inference host needs it) and put the root logger back to its previous
   level, with JetStream's handler at WARNING.

Import JetStream only through this module: ``from sao_jax.rollout.jetstream_compat import engine_api``.
"""

import importlib.util
import sys
import types

import jax


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


_install_seqio_stub()
if not hasattr(jax, "tree_map"):
  jax.tree_map = jax.tree.map

# pylint: disable=wrong-import-position
from jetstream.engine import engine_api  # noqa: E402
from jetstream.engine import tokenizer_api  # noqa: E402
from jetstream.engine import tokenizer_pb2  # noqa: E402



def _import_core(name: str):
  import importlib  # pylint: disable=import-outside-toplevel  (imported with the stub installation, which must run first)
  import logging  # pylint: disable=import-outside-toplevel  (imported with the stub installation, which must run first)
  root = logging.getLogger()
  level, handlers = root.level, list(root.handlers)
  module = importlib.import_module(f"jetstream.core.{name}")
  root.setLevel(level)
  for h in root.handlers:
    if h not in handlers:
      h.setLevel(logging.WARNING)
  return module


def orchestrator():
  """``jetstream.core.orchestrator`` (imported on first use, logging side effects undone)."""
  return _import_core("orchestrator")


def server_lib():
  """``jetstream.core.server_lib`` (JetStream's gRPC server)."""
  orchestrator()
  return _import_core("server_lib")


def config_lib():
  """``jetstream.core.config_lib`` (``ServerConfig``)."""
  return _import_core("config_lib")


def decode_pb():
  """(``jetstream_pb2``, ``jetstream_pb2_grpc``): JetStream's client API for ``Decode``."""
  from jetstream.core.proto import jetstream_pb2, jetstream_pb2_grpc  # pylint: disable=import-outside-toplevel  (JetStream loads only after its stubs are in place)
  return jetstream_pb2, jetstream_pb2_grpc


__all__ = ["engine_api", "tokenizer_api", "tokenizer_pb2", "orchestrator", "server_lib",
           "config_lib", "decode_pb"]
