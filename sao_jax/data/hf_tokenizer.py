"""Tokenizers of real checkpoints: ``tokenizer.json`` (the ``tokenizers`` library) + chat template.

``HFTokenizer`` exposes what the rest of sao_jax expects from a tokenizer (``encode``, ``decode``,
``pad_id``, ``eos_id``, ``bos_id``, ``stop_ids``, ``vocab_size``), so it plugs into the JetStream
engine (``SAOEngine.build_tokenizer``), the rollout worker and the environments, plus
``apply_chat_template`` which renders the checkpoint's Jinja chat template exactly as
``transformers``' ``apply_chat_template`` does (sandboxed Jinja, ``trim_blocks`` and
``lstrip_blocks``, ``tojson`` filter, ``raise_exception``), so prompts are built the way the model
was trained to see them.

Sources: a Hugging Face checkpoint folder (``tokenizer.json`` + ``tokenizer_config.json``) or a
llama.cpp GGUF file (vocab + merges rebuilt as a byte-level BPE).
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterable, Optional, Sequence
from gguf import GGUFReader
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from sao_jax.models.gguf_loader import resolve_gguf_path
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

# ChatML, used when a checkpoint ships no template (SmolLM2, Qwen style)
CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def _token_str(v) -> Optional[str]:
  if v is None:
    return None
  if isinstance(v, dict):
    return v.get("content")
  return str(v)


class HFTokenizer:
  """A ``tokenizers.Tokenizer`` with special-token ids and a chat template.

  Args:
    tokenizer: a ``tokenizers.Tokenizer``.
    chat_template: Jinja source (or None: ``apply_chat_template`` raises).
    eos_token / bos_token / pad_token: special token strings (bos may be None); ``pad_token``
      defaults to the eos token.
    extra_stop_tokens: more tokens that end a policy turn (e.g. ``<|endoftext|>``).
  Raises ValueError when a named special token is not in the vocabulary.
  """

  def __init__(self, tokenizer, *, chat_template: Optional[str] = None,
               eos_token: Optional[str] = None, bos_token: Optional[str] = None,
               pad_token: Optional[str] = None, extra_stop_tokens: Sequence[str] = ()):
    self._tok = tokenizer
    self.chat_template = chat_template
    self.eos_token, self.bos_token = eos_token, bos_token
    self.pad_token = pad_token or eos_token

    def tid(s, what):
      if s is None:
        return None
      i = tokenizer.token_to_id(s)
      if i is None:
        raise ValueError(f"{what} token {s!r} is not in the tokenizer vocabulary.")
      return int(i)

    self._eos = tid(eos_token, "eos")
    self._bos = tid(bos_token, "bos")
    self._pad = tid(self.pad_token, "pad")
    extra = [tid(s, "stop") for s in extra_stop_tokens if tokenizer.token_to_id(s) is not None]
    self._stop = tuple(dict.fromkeys([i for i in [self._eos, *extra] if i is not None]))

  # ---- constructors -------------------------------------------------------------------------
  @classmethod
  def from_pretrained(cls, path: str) -> "HFTokenizer":
    """From a checkpoint folder with ``tokenizer.json`` (and optionally
    ``tokenizer_config.json``: eos/bos/pad tokens and ``chat_template``; or a
    ``chat_template.jinja`` file). Raises FileNotFoundError naming the missing file."""
    tj = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tj):
      raise FileNotFoundError(f"{path!r} has no tokenizer.json (the `tokenizers` format); "
                              f"save it with tokenizer.save_pretrained().")
    conf = {}
    tc = os.path.join(path, "tokenizer_config.json")
    if os.path.isfile(tc):
      with open(tc, encoding="utf-8") as f:
        conf = json.load(f)
    template = conf.get("chat_template")
    if isinstance(template, list):  # named templates: take "default"
      template = {t["name"]: t["template"] for t in template}.get("default")
    jinja = os.path.join(path, "chat_template.jinja")
    if template is None and os.path.isfile(jinja):
      with open(jinja, encoding="utf-8") as f:
        template = f.read()
    tok = Tokenizer.from_file(tj)
    eos = _token_str(conf.get("eos_token"))
    if eos is None:
      gen = os.path.join(path, "generation_config.json")
      cfgj = os.path.join(path, "config.json")
      for fn in (gen, cfgj):
        if eos is None and os.path.isfile(fn):
          with open(fn, encoding="utf-8") as f:
            e = json.load(f).get("eos_token_id")
          e = e[0] if isinstance(e, list) else e
          eos = tok.id_to_token(int(e)) if e is not None else None
    return cls(tok, chat_template=template, eos_token=eos,
               bos_token=_token_str(conf.get("bos_token")),
               pad_token=_token_str(conf.get("pad_token")),
               extra_stop_tokens=("<|im_end|>", "<|endoftext|>"))

  @classmethod
  def from_gguf(cls, path: str) -> "HFTokenizer":
    """Byte-level BPE rebuilt from a llama.cpp GGUF's ``tokenizer.ggml.*`` vocab and merges
    (single-digit pre-split, as SmolLM2's ``smollm`` pre-tokenizer); chat template from
    ``tokenizer.chat_template`` or ChatML. ``path``: a ``.gguf`` file or ``"smollm2"``."""
    reader = GGUFReader(resolve_gguf_path(path))

    def field(k, default=None):
      f = reader.fields.get(k)
      return default if f is None else f.contents()

    model = field("tokenizer.ggml.model")
    if model != "gpt2":
      raise ValueError(f"GGUF tokenizer.ggml.model={model!r}; only byte-level BPE ('gpt2') is "
                       f"supported.")
    toks = field("tokenizer.ggml.tokens")
    types = field("tokenizer.ggml.token_type")
    merges = [tuple(m.split(" ", 1)) for m in field("tokenizer.ggml.merges")]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(toks)}, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(toks[i], special=True, normalized=False)
                            for i, t in enumerate(types) if t == 3])  # 3 = CONTROL

    def name(key):
      i = field(key)
      return None if i is None else toks[int(i)]

    eos = name("tokenizer.ggml.eos_token_id")
    bos = name("tokenizer.ggml.bos_token_id")
    pad = name("tokenizer.ggml.padding_token_id")
    template = field("tokenizer.chat_template") or CHATML_TEMPLATE
    return cls(tok, chat_template=template, eos_token=eos,
               bos_token=None if bos == eos else bos, pad_token=pad,
               extra_stop_tokens=("<|im_end|>", "<|endoftext|>"))

  # ---- the sao_jax tokenizer interface ------------------------------------------------------
  @property
  def vocab_size(self) -> int:
    return int(self._tok.get_vocab_size(with_added_tokens=True))

  @property
  def pad_id(self) -> int:
    return self._pad if self._pad is not None else 0

  @property
  def eos_id(self) -> Optional[int]:
    return self._eos

  @property
  def bos_id(self) -> Optional[int]:
    """None when the model uses no BOS token (Qwen3, SmolLM2 chat): nothing is prepended."""
    return self._bos

  @property
  def stop_ids(self) -> tuple[int, ...]:
    """Tokens that end a policy turn: eos plus ``<|im_end|>`` / ``<|endoftext|>`` if present."""
    return self._stop

  def token_to_id(self, token: str) -> Optional[int]:
    return self._tok.token_to_id(token)

  def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
    """Text -> ids; special tokens written literally (``<|im_start|>``) become their id."""
    if not isinstance(text, str):
      raise TypeError(f"encode expects str, got {type(text).__name__}")
    ids = list(self._tok.encode(text, add_special_tokens=False).ids)
    if add_bos and self._bos is not None:
      ids.insert(0, self._bos)
    if add_eos and self._eos is not None:
      ids.append(self._eos)
    return ids

  def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special)

  def __len__(self) -> int:
    return self.vocab_size

  # ---- chat template ------------------------------------------------------------------------
  def apply_chat_template(self, messages: Sequence[dict], *, add_generation_prompt: bool = True,
                          tokenize: bool = False, **kwargs: Any):
    """Renders ``messages`` ([{"role", "content"}]) with the checkpoint's chat template.

    Extra kwargs reach the template (e.g. ``enable_thinking=False`` for Qwen3). Returns the
    prompt text, or its ids when ``tokenize``. Raises ValueError if the tokenizer has no
    template, or whatever the template raises via ``raise_exception``."""
    if not self.chat_template:
      raise ValueError("this tokenizer has no chat template (tokenizer_config.json "
                       "chat_template); build the prompt text yourself.")
    text = _compiled(self.chat_template).render(
        messages=list(messages), add_generation_prompt=add_generation_prompt,
        bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs)
    return self.encode(text) if tokenize else text

  def __repr__(self) -> str:
    return f"HFTokenizer(vocab_size={self.vocab_size}, eos={self.eos_token!r})"


_TEMPLATES: dict = {}


def _compiled(source: str):
  if source not in _TEMPLATES:

    def raise_exception(message):
      raise ValueError(f"chat template: {message}")

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
      return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                        sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    _TEMPLATES[source] = env.from_string(source)
  return _TEMPLATES[source]
