"""Character-level tokenizer for the on-CPU demos.

Vocabulary (fixed order; ``vocab_size == 104``):

====  ==========================================================
id    token
====  ==========================================================
0     ``<pad>``
1     ``<bos>``
2     ``<eos>``
3     ``<unk>``
4     ``<tool>``
5     ``</tool>``
6     ``<obs>``
7     ``</obs>``
8..   printable ASCII characters 32..126 in code-point order, i.e.
      id = 8 + (ord(c) - 32): ``" "`` -> 8, ``"0"`` -> 24, ``"A"`` -> 41,
      ``"a"`` -> 73, ``"~"`` -> 102
103   ``"\\n"``
====  ==========================================================

``encode`` parses special tokens written literally in the text (``"<tool>"``
becomes the single id 4, never the six characters); any other character
outside the vocabulary becomes ``<unk>``.  ``decode`` writes special tokens
back literally (unless ``skip_special=True``), so for any text made of
printable ASCII and ``"\\n"``, ``decode(encode(text)) == text``.

The mapping is a pure function of the character (no merges), so encoding is
compositional: ``encode(a + b) == encode(a) + encode(b)`` as long as the cut
does not split a literal special token.
"""

from __future__ import annotations

from typing import Iterable, Sequence

SPECIAL_TOKENS: tuple[str, ...] = (
    "<pad>",
    "<bos>",
    "<eos>",
    "<unk>",
    "<tool>",
    "</tool>",
    "<obs>",
    "</obs>",
)
CHARS: tuple[str, ...] = tuple(chr(c) for c in range(32, 127)) + ("\n",)


class CharTokenizer:
  """Character-level tokenizer with 8 special tokens (see module docstring)."""

  def __init__(self) -> None:
    self._id_to_tok: tuple[str, ...] = SPECIAL_TOKENS + CHARS
    self._char_to_id: dict[str, int] = {
        c: i + len(SPECIAL_TOKENS) for i, c in enumerate(CHARS)
    }
    self._special_to_id: dict[str, int] = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    # All specials start with "<"; try longer ones first (none is a prefix
    # of another today, but keep the parse greedy-longest regardless).
    self._specials_longest_first = sorted(SPECIAL_TOKENS, key=len, reverse=True)

  # ------------------------------------------------------------------ ids
  @property
  def vocab_size(self) -> int:
    return len(self._id_to_tok)

  @property
  def pad_id(self) -> int:
    return 0

  @property
  def bos_id(self) -> int:
    return 1

  @property
  def eos_id(self) -> int:
    return 2

  @property
  def unk_id(self) -> int:
    return 3

  @property
  def tool_start_id(self) -> int:
    return 4

  @property
  def tool_end_id(self) -> int:
    return 5

  @property
  def obs_start_id(self) -> int:
    return 6

  @property
  def obs_end_id(self) -> int:
    return 7

  @property
  def stop_ids(self) -> tuple[int, ...]:
    """Tokens that end a policy turn: ``(eos_id, tool_end_id)``."""
    return (self.eos_id, self.tool_end_id)

  @property
  def special_ids(self) -> tuple[int, ...]:
    return tuple(range(len(SPECIAL_TOKENS)))

  # -------------------------------------------------------------- methods
  def token_to_id(self, token: str) -> int:
    if token in self._special_to_id:
      return self._special_to_id[token]
    return self._char_to_id.get(token, self.unk_id)

  def id_to_token(self, i: int) -> str:
    i = int(i)
    if 0 <= i < len(self._id_to_tok):
      return self._id_to_tok[i]
    return SPECIAL_TOKENS[self.unk_id]

  def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
    """Text -> ids. Literal special tokens are parsed to their single id."""
    if not isinstance(text, str):
      raise TypeError(f"encode expects str, got {type(text).__name__}")
    ids: list[int] = [self.bos_id] if add_bos else []
    i, n = 0, len(text)
    char_to_id, unk = self._char_to_id, self.unk_id
    while i < n:
      c = text[i]
      if c == "<":
        for tok in self._specials_longest_first:
          if text.startswith(tok, i):
            ids.append(self._special_to_id[tok])
            i += len(tok)
            break
        else:
          ids.append(char_to_id[c])
          i += 1
        continue
      ids.append(char_to_id.get(c, unk))
      i += 1
    if add_eos:
      ids.append(self.eos_id)
    return ids

  def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
    """Ids -> text.

    Special tokens are written literally (``"<tool>"``...) unless
    ``skip_special``, which drops all 8 special ids. Ids outside the
    vocabulary (e.g. from a model whose embedding is padded past
    ``vocab_size``) are treated as ``<unk>``; decoding never raises.
    """
    n_special = len(SPECIAL_TOKENS)
    table = self._id_to_tok
    out: list[str] = []
    for i in ids:
      i = int(i)
      if 0 <= i < len(table):
        if skip_special and i < n_special:
          continue
        out.append(table[i])
      elif not skip_special:
        out.append(SPECIAL_TOKENS[self.unk_id])
    return "".join(out)

  def batch_decode(self, seqs: Sequence[Iterable[int]], skip_special: bool = False) -> list[str]:
    return [self.decode(s, skip_special=skip_special) for s in seqs]

  def __len__(self) -> int:
    return self.vocab_size

  def __repr__(self) -> str:
    return f"CharTokenizer(vocab_size={self.vocab_size})"
