"""Tests for sao_jax.data: CharTokenizer and JSONL loading."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sao_jax.data.jsonl import Problem, load_math_problems, packaged_path, read_jsonl
from sao_jax.data.tokenizer import SPECIAL_TOKENS, CharTokenizer

TOK = CharTokenizer()
VOCAB_CHARS = "".join(chr(c) for c in range(32, 127)) + "\n"


# ----------------------------------------------------------------- tokenizer
def test_tokenizer_ids_and_properties():
  assert TOK.vocab_size == 104 == len(TOK)
  assert (TOK.pad_id, TOK.bos_id, TOK.eos_id) == (0, 1, 2)
  assert (TOK.tool_start_id, TOK.tool_end_id, TOK.obs_start_id, TOK.obs_end_id) == (4, 5, 6, 7)
  assert TOK.stop_ids == (TOK.eos_id, TOK.tool_end_id)
  assert TOK.encode(" ") == [8]
  assert TOK.encode("0") == [24]
  assert TOK.encode("~") == [102]
  assert TOK.encode("\n") == [103]
  for i, tok in enumerate(SPECIAL_TOKENS):
    assert TOK.encode(tok) == [i]
    assert TOK.decode([i]) == tok


def test_tokenizer_roundtrip_all_chars():
  ids = TOK.encode(VOCAB_CHARS)
  assert ids == list(range(8, 104))
  assert TOK.decode(ids) == VOCAB_CHARS


def test_tokenizer_specials_parsed_in_text():
  text = "<bos>Compute 1+2.\n<tool>1+2</tool><obs>3</obs>\\boxed{3}<eos>"
  ids = TOK.encode(text)
  assert ids[0] == TOK.bos_id and ids[-1] == TOK.eos_id
  assert ids.count(TOK.tool_start_id) == 1 and ids.count(TOK.tool_end_id) == 1
  assert ids.count(TOK.obs_start_id) == 1 and ids.count(TOK.obs_end_id) == 1
  assert TOK.decode(ids) == text
  assert TOK.decode(ids, skip_special=True) == "Compute 1+2.\n1+23\\boxed{3}"
  # "<" not starting a special token is an ordinary character
  assert TOK.decode(TOK.encode("a<b <tool x</obs")) == "a<b <tool x</obs"
  assert TOK.encode("</obs")[0] == TOK.encode("<")[0]


def test_tokenizer_unknown_and_out_of_range():
  assert TOK.encode("é\t") == [TOK.unk_id, TOK.unk_id]
  assert TOK.decode([500, -1, 24]) == "<unk><unk>0"
  assert TOK.decode([500, 24], skip_special=True) == "0"
  assert TOK.encode("x", add_bos=True, add_eos=True) == [1, TOK.encode("x")[0], 2]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(list(VOCAB_CHARS) + list(SPECIAL_TOKENS)),
                max_size=60).map("".join))
def test_tokenizer_roundtrip_property(text):
  assert TOK.decode(TOK.encode(text)) == text


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, TOK.vocab_size - 1), max_size=60))
def test_tokenizer_ids_roundtrip_property(ids):
  assert TOK.encode(TOK.decode(ids)) == ids


# --------------------------------------------------------------------- jsonl
def _write(tmp_path, name, content: bytes):
  p = tmp_path / name
  p.write_bytes(content)
  return p


def test_read_jsonl_ok_skips_blank_lines(tmp_path):
  p = _write(
      tmp_path,
      "ok.jsonl",
      b'{"id": "a", "problem": "1+1?", "answer": "2"}\n\n   \n'
      b'{"id": "b", "problem": "2+2?", "answer": 4, "extra": true}\n',
  )
  rows = read_jsonl(p)
  assert [r["id"] for r in rows] == ["a", "b"]
  probs = load_math_problems(p)
  assert probs == [Problem("a", "1+1?", "2"), Problem("b", "2+2?", "4")]
  with pytest.raises(dataclasses.FrozenInstanceError):
    probs[0].answer = "3"  # type: ignore[misc]


GOOD = b'{"id": "a", "problem": "p", "answer": "1"}\n'


@pytest.mark.parametrize(
    "name,content,lineno,needle",
    [
        ("badjson.jsonl", GOOD + b'{"id": "b", "problem": "p", "answer": }\n', 2, "invalid JSON"),
        ("missing.jsonl", GOOD + b"\n" + b'{"id": "b", "problem": "p"}\n', 3, "answer"),
        ("utf8.jsonl", GOOD + b'{"id": "b", "problem": "\xff\xfe", "answer": "1"}\n', 2, "UTF-8"),
        ("notobj.jsonl", b"[1, 2]\n", 1, "JSON object"),
        ("trunc.jsonl", GOOD + GOOD + b'{"id": "c", "prob', 3, "invalid JSON"),
    ],
)
def test_read_jsonl_errors_name_file_and_line(tmp_path, name, content, lineno, needle):
  p = _write(tmp_path, name, content)
  with pytest.raises(ValueError) as ei:
    read_jsonl(p)
  msg = str(ei.value)
  assert name in msg
  assert f":{lineno}:" in msg
  assert needle in msg


def test_read_jsonl_custom_required(tmp_path):
  p = _write(tmp_path, "x.jsonl", b'{"q": 1}\n')
  assert read_jsonl(p, required=("q",)) == [{"q": 1}]
  with pytest.raises(ValueError, match=r"x\.jsonl:1:.*'id'"):
    read_jsonl(p)


def test_load_math_problems_bad_fields(tmp_path):
  p = _write(tmp_path, "dup.jsonl", GOOD + b"\n" + GOOD)
  with pytest.raises(ValueError, match=r"dup\.jsonl:3: duplicate id 'a' \(first on line 1\)"):
    load_math_problems(p)
  p = _write(tmp_path, "types.jsonl", GOOD + b'{"id": "b", "problem": "p", "answer": [1]}\n')
  with pytest.raises(ValueError, match=r"types\.jsonl:2: field 'answer'"):
    load_math_problems(p)


def test_missing_file(tmp_path):
  with pytest.raises(FileNotFoundError):
    read_jsonl(tmp_path / "nope.jsonl")


def test_packaged_path():
  assert packaged_path("aime25.jsonl").endswith("aime25.jsonl")
  with pytest.raises(FileNotFoundError, match="aime25.jsonl"):
    packaged_path("nope.jsonl")
  with pytest.raises(ValueError):
    packaged_path("../jsonl.py")


def test_aime25_loads_30_problems():
  probs = load_math_problems(packaged_path("aime25.jsonl"))
  assert len(probs) == 30
  assert len({p.id for p in probs}) == 30
  assert all(p.prompt.strip() and p.answer.isdigit() for p in probs)
  assert probs[0].answer == "70"
  # the char tokenizer can encode every problem (unknown chars -> <unk>)
  for p in probs:
    ids = TOK.encode(p.prompt)
    assert ids and all(0 <= i < TOK.vocab_size for i in ids)
