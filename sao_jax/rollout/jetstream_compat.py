"""The one place where sao_jax imports google-jetstream 0.2.2 (its Engine API).

``SAOEngine`` implements JetStream's ``engine_api.Engine``; sao_jax uses JetStream's engine and
tokenizer API only (not its orchestrator or gRPC server). Two facts about JetStream 0.2.2 are
handled here and nowhere else:

1. ``jetstream.engine.token_utils`` (imported by ``engine_api``) imports ``seqio`` at import time
   for its SentencePiece tokenizer, and JetStream's pip metadata pulls ``seqio`` and with it
   TensorFlow (several GB). sao_jax never uses SentencePiece through JetStream: it installs
   JetStream with ``pip install --no-deps`` (see ``requirements-nodeps.txt``) and, when ``seqio`` is
   not importable, registers a stub ``seqio.vocabularies`` module whose two classes raise if ever
   instantiated. A real ``seqio``, when installed, is used untouched.
2. Because of 1, ``pip install -e .`` cannot pull JetStream in (``pyproject.toml`` does not list
   it): when it is missing, importing this module raises ``ImportError`` with the install command.

Import JetStream only through this module:
``from sao_jax.rollout.jetstream_compat import engine_api``.
"""

import importlib.util
import sys
import types

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


if importlib.util.find_spec("jetstream") is None:
  raise ImportError(
      "google-jetstream is not installed (the rollout engine implements its Engine API). Install "
      f"it without its dependencies (they pull TensorFlow, which sao_jax does not use): "
      f"`{JETSTREAM_INSTALL}` (./install.sh does this).")
_install_seqio_stub()

# pylint: disable=wrong-import-position
from jetstream.engine import engine_api  # noqa: E402
from jetstream.engine import tokenizer_api  # noqa: E402
from jetstream.engine import tokenizer_pb2  # noqa: E402

__all__ = ["engine_api", "tokenizer_api", "tokenizer_pb2"]
