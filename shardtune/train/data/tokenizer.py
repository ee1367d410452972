"""Tokenizers behind one small interface: the built-in byte-level one and a model folder's own.

Both expose `encode(text) -> list[int]` (no special tokens added), `decode(ids)`, `bos_id`,
`eos_id`, `pad_id` (ints; `bos_id` may be None for models without one, e.g. Qwen2),
`vocab_size`, `chat_template` (str or None), `render_chat(messages)` and `save_pretrained(dir)`.

The byte tokenizer: ids 0..255 are the UTF-8 bytes, 256 = bos, 257 = eos, 258 = pad, so it fits
the `tiny-llama` catalogue entry (vocab_size 264 = 259 padded to a multiple of 8). Its
`save_pretrained` writes a Hugging Face fast tokenizer (tokenizer.json: a byte-level BPE with no
merges, so `AutoTokenizer.from_pretrained(dir)` gives the same ids) for the exported HF folder.
Imports no torch; transformers only when a model folder's tokenizer or an export needs it.
"""
from __future__ import annotations

import os
from pathlib import Path

from shardtune.errors import UserError

# The plain chat template (used when the tokenizer has none): each turn is a header line then the
# content; an assistant turn ends with eos instead of a newline. Loss: assistant content + eos.
PLAIN_HEADER = "<|{role}|>\n"
# The same template in Jinja, stored in an exported byte tokenizer for `apply_chat_template`.
PLAIN_CHAT_JINJA = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n"
    "{% if m['role'] == 'assistant' %}{{ m['content'] }}{{ eos_token }}{% else %}{{ m['content'] }}\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


class ByteTokenizer:
    """UTF-8 bytes as ids, plus bos/eos/pad. No chat template (the plain one is used)."""

    name = "byte"
    bos_id: int | None = 256
    eos_id: int = 257
    pad_id: int = 258
    vocab_size: int = 259
    chat_template: str | None = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        ids = [int(i) for i in ids]
        if skip_special_tokens:
            return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
        names = {self.bos_id: "<s>", self.eos_id: "</s>", self.pad_id: "<pad>"}
        out, buf = [], bytearray()
        for i in ids:
            if i < 256:
                buf.append(i)
                continue
            out.append(buf.decode("utf-8", errors="replace"))
            buf = bytearray()
            out.append(names.get(i, f"<{i}>"))
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)

    def bos_prefix(self) -> list[int]:
        """Ids the tokenizer puts before a document: [bos]."""
        return [self.bos_id]

    def render_chat(self, messages: list[dict]) -> list[tuple[list[int], bool]]:
        return render_plain_chat(self, messages)

    def to_hf(self):
        """An equivalent transformers `PreTrainedTokenizerFast` (for export and for checking ids)."""
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
        from transformers import PreTrainedTokenizerFast

        # GPT-2's byte → printable-char map makes every byte one BPE symbol; with no merges the
        # BPE emits exactly one id per byte, and id = byte value.
        byte_to_char = pre_tokenizers.ByteLevel.alphabet()
        table = _gpt2_bytes_to_unicode()
        assert set(table.values()) == set(byte_to_char)
        vocab = {table[b]: b for b in range(256)}
        tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        # like Llama's tokenizer, put bos before a text, so `tok(text)` matches what was trained on
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                           special_tokens=[("<s>", 256)])
        hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                     pad_token="<pad>", model_max_length=10**9)
        # special tokens appended after the 256 bytes, in the order bos, eos, pad
        hf.add_special_tokens({"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"})
        assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (256, 257, 258)
        hf.chat_template = PLAIN_CHAT_JINJA
        return hf

    def save_pretrained(self, directory: str | os.PathLike) -> None:
        """Write tokenizer.json + tokenizer_config.json + special_tokens_map.json (HF format)."""
        self.to_hf().save_pretrained(str(directory))


def _gpt2_bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte → unicode map (openai/gpt-2 encoder.py `bytes_to_unicode`)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


class HFTokenizer:
    """A transformers tokenizer from a model folder, behind the same interface."""

    name = "hf"

    def __init__(self, tok):
        self.tok = tok
        self.bos_id = tok.bos_token_id
        self.eos_id = tok.eos_token_id
        if self.eos_id is None:
            raise UserError("the model folder's tokenizer has no eos token; set data.tokenizer=byte or add eos_token "
                            "to tokenizer_config.json")
        # Llama-3 and Qwen2 tokenizers have no pad token: pad with eos (padding never gets a label).
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else self.eos_id
        self.vocab_size = len(tok)
        self.chat_template = getattr(tok, "chat_template", None)
        with_special = tok("a", add_special_tokens=True)["input_ids"]
        plain = tok("a", add_special_tokens=False)["input_ids"]
        # what the tokenizer itself puts before a text (Llama: <s> / <|begin_of_text|>, Qwen2: none)
        self._prefix = with_special[: len(with_special) - len(plain)] if with_special[-len(plain):] == plain else []

    def encode(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def bos_prefix(self) -> list[int]:
        return list(self._prefix)

    def render_chat(self, messages: list[dict]) -> list[tuple[list[int], bool]]:
        if not self.chat_template:
            return render_plain_chat(self, messages)
        return _render_with_template(self, messages)

    def save_pretrained(self, directory: str | os.PathLike) -> None:
        self.tok.save_pretrained(str(directory))


def render_plain_chat(tok, messages: list[dict]) -> list[tuple[list[int], bool]]:
    """The plain template: `<|role|>\\n` + content + (`\\n`, or eos for the assistant).

    Returns (ids, is_target) segments; targets are the assistant contents and their eos.
    """
    segs: list[tuple[list[int], bool]] = [(tok.bos_prefix(), False)]
    for m in messages:
        segs.append((tok.encode(PLAIN_HEADER.format(role=m["role"])), False))
        if m["role"] == "assistant":
            segs.append((tok.encode(m["content"]) + [tok.eos_id], True))
        else:
            segs.append((tok.encode(m["content"] + "\n"), False))
    return segs


def _render_with_template(tok: HFTokenizer, messages: list[dict]) -> list[tuple[list[int], bool]]:
    """Render with the tokenizer's chat template, marking each assistant turn as a target.

    The conversation is rendered incrementally: for assistant turn i, the text of turns [0, i)
    with the generation prompt is the context, and what turn i adds beyond it is the target
    (content plus the template's end-of-turn tokens). Segments are tokenized one by one, which
    matches whole-text tokenization when segment borders are special tokens (true of the
    Llama-3, Qwen2 and Mistral templates). A template whose renderings are not prefixes of one
    another (some rewrite earlier turns) is refused with a fix.
    """
    from jinja2 import TemplateError

    def render(msgs, **kw):
        try:
            return tok.tok.apply_chat_template(msgs, **kw)
        except TemplateError as e:  # the template's raise_exception: e.g. Gemma's "System role not supported"
            roles = "/".join(m["role"] for m in messages)
            raise UserError(f"the chat template refuses a conversation ({roles}): {e}; fix the data or "
                            "data.system_prompt, or choose another data.chat_template") from None

    segs: list[tuple[list[int], bool]] = []
    done = ""
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            ctx = render(messages[:i], tokenize=False, add_generation_prompt=True) if i else ""
            _check_prefix(done, ctx)
            segs.append((tok.encode(ctx[len(done):]), False))
            done = ctx
        full = render(messages[: i + 1], tokenize=False)
        _check_prefix(done, full)
        segs.append((tok.encode(full[len(done):]), m["role"] == "assistant"))
        done = full
    return segs


def _check_prefix(prefix: str, text: str) -> None:
    if not text.startswith(prefix):
        raise UserError("the tokenizer's chat template rewrites earlier turns, so assistant tokens cannot be marked; "
                        "set data.template=plain")


def load_tokenizer(kind: str, model_name: str, trust_remote_code: bool = False):
    """`kind` auto: the model folder's tokenizer when it has one, else bytes; `byte`: bytes."""
    if kind == "byte":
        return ByteTokenizer()
    folder = Path(model_name).expanduser()
    has_files = folder.is_dir() and any((folder / f).is_file() for f in (
        "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json"))
    if kind == "hf" and not has_files:
        raise UserError(f"data.tokenizer=hf but {model_name!r} is not a model folder with tokenizer files; use "
                        "data.tokenizer=auto or byte")
    if not has_files:
        return ByteTokenizer()
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True, trust_remote_code=trust_remote_code)
    except Exception as e:  # a broken folder: one line naming it, not a transformers traceback
        raise UserError(f"cannot load the tokenizer of {model_name!r}: {' '.join(str(e).split())[:200]}; fix the "
                        "folder or set data.tokenizer=byte") from None
    return HFTokenizer(tok)
