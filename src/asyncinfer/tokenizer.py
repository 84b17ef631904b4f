"""Text to token ids and back over a Hugging Face tokenizer, and streamed text deltas."""

from __future__ import annotations

import functools
import json
import os
import re
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from asyncinfer.errors import InvalidRequestError, ModelNotFoundError
from asyncinfer.params import SamplingParams

_CONTEXT_TOKENS = 5  # prompt ids decoded before the first output (SentencePiece's space)
_REPLACEMENT = "\ufffd"

# Names a chat template's call binds itself (the template's variables and transformers'
# parameters): a template variable of the request cannot take them.
TEMPLATE_NAMES = frozenset({
    "messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
    "conversation", "conversations", "chat_template", "tokenize", "padding", "truncation",
    "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
    "tokenizer_kwargs", "sanitize_control_tokens"})


@attrs.frozen
class _ChatOptions:
    """How one chat is rendered, besides its messages."""

    add_generation_prompt: bool
    continue_final_message: bool
    kwargs: dict[str, Any]


def _checked_kwargs(kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """Template variables whose names a template can read and the call does not bind."""
    kwargs = dict(kwargs or {})
    for name in kwargs:
        if not (isinstance(name, str) and name.isidentifier()):
            raise InvalidRequestError(f"chat_template_kwargs: {name!r} is not a name a "
                                      f"template can read", param="chat_template_kwargs")
        if name in TEMPLATE_NAMES:
            raise InvalidRequestError(
                f"chat_template_kwargs: {name!r} is set by the server (use the request's own "
                f"field where there is one)", param="chat_template_kwargs")
    return kwargs


def _replace_strings(value: Any, needs: Callable[[str], bool],
                     replace: Callable[[str], str]) -> Any:
    """``value`` (nested lists and mappings) with each string that ``needs`` replaced."""
    if isinstance(value, str):
        return replace(value) if needs(value) else value
    if isinstance(value, Mapping):
        return {_replace_strings(k, needs, replace): _replace_strings(v, needs, replace)
                for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_replace_strings(v, needs, replace) for v in value]
    return value


class Tokenizer:
    """A Hugging Face tokenizer with the few operations the engine and server need."""

    def __init__(self, hf_tokenizer: Any, extra_eos_ids: Sequence[int] = ()) -> None:
        self.hf = hf_tokenizer
        eos = set(extra_eos_ids)
        if hf_tokenizer.eos_token_id is not None:
            eos.add(int(hf_tokenizer.eos_token_id))
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        self._pieces: dict[int, tuple[str, bytes]] = {}

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Load the tokenizer of a local model directory (no network)."""
        from transformers import AutoTokenizer

        try:
            hf = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as exc:
            raise ModelNotFoundError(f"no usable tokenizer in {path}: {exc}") from exc
        return cls(hf, _generation_eos_ids(Path(path)))

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer knows, added tokens included."""
        return len(self.hf)

    def warm(self) -> Tokenizer:
        """Build now what the first encode would otherwise build (the two encoders, a
        fifth of a second for a 49k vocabulary): a server does it before it answers ready,
        so that its first requests do not queue behind it."""
        self._encoders  # noqa: B018 - a cached property, built for its side effect
        return self

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The longest vocabulary entry (docs/architecture.md, 'Tokenizer bounds')."""
        return max((len(token) for token in self.hf.get_vocab()), default=1)

    def encode(self, text: str, special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; with ``special_tokens=False`` a special token's text
        (``<|im_end|>``) is plain text, so untrusted text cannot make control tokens."""
        return list(self._encoders[not special_tokens].encode(text).ids)

    def apply_chat_template(self, messages: list[dict[str, str]],
                            special_tokens: bool = True, *,
                            add_generation_prompt: bool = True,
                            continue_final_message: bool = False,
                            template_kwargs: Mapping[str, Any] | None = None,
                            tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
        """Token ids of the chat in the model's template, ending in the assistant turn; with
        ``special_tokens=False`` the contents are plain text, the template's tokens stay.

        ``add_generation_prompt=False`` leaves out the new assistant turn's header;
        ``continue_final_message`` renders the last message (the assistant's) open, for the
        model to continue; ``template_kwargs`` are more variables for the template (such as
        Qwen3's ``enable_thinking``), user text too: their strings are plain text as well;
        ``tools``: the functions the template lists (OpenAI's ``tools``). A message may carry
        more than role and content (``tool_calls``, ``tool_call_id``), for the template."""
        if not getattr(self.hf, "chat_template", None):
            raise InvalidRequestError(
                "this model's tokenizer has no chat template; send a plain prompt instead")
        if not isinstance(messages, list) or not messages:
            raise InvalidRequestError("messages must be a non-empty list")
        for i, message in enumerate(messages):
            if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                    and isinstance(message.get("content"), str)):
                raise InvalidRequestError(
                    f"messages[{i}] must have a string 'role' and a string 'content'")
        kwargs = _checked_kwargs(template_kwargs)
        if tools:
            kwargs["tools"] = list(tools)
        chat = _ChatOptions(add_generation_prompt, continue_final_message, kwargs)
        if continue_final_message:
            if add_generation_prompt:
                raise InvalidRequestError(
                    "continue_final_message and add_generation_prompt cannot both be true",
                    param="continue_final_message")
            if messages[-1]["role"] != "assistant":
                raise InvalidRequestError(
                    f"continue_final_message continues the assistant's last message, but the "
                    f"last message is the {messages[-1]['role']!r}'s",
                    param="continue_final_message")
        if special_tokens or not (any(self._spells_special_in(m) for m in messages)
                                  or self._spells_special_in(chat.kwargs)):
            return list(self._render(messages, chat, tokenize=True))
        return self._render_content_as_text(messages, chat)

    def _render(self, messages: list[dict[str, str]], chat: _ChatOptions,
                tokenize: bool) -> Any:
        from jinja2 import TemplateError

        try:
            return self.hf.apply_chat_template(
                messages, add_generation_prompt=chat.add_generation_prompt,
                continue_final_message=chat.continue_final_message, tokenize=tokenize,
                return_dict=False, **chat.kwargs)
        except TemplateError as exc:
            raise InvalidRequestError(f"the chat template rejected the messages: {exc}") from exc
        except ValueError as exc:  # transformers' refusal: the template dropped the last text
            if not chat.continue_final_message:
                raise
            raise InvalidRequestError(
                f"continue_final_message: this chat template does not render the last "
                f"message as sent, so it cannot be continued ({str(exc).splitlines()[0]})",
                param="continue_final_message") from exc
        except (ArithmeticError, LookupError, TypeError, AttributeError,
                RecursionError) as exc:
            if not chat.kwargs:
                raise
            # The template did something with a variable of the request that it cannot do.
            raise InvalidRequestError(
                f"the chat template failed on the chat_template_kwargs: "
                f"{type(exc).__name__}: {exc}", param="chat_template_kwargs") from exc

    def _spells_special(self, text: str) -> bool:
        return any(token in text for token in self._special_texts)

    def _spells_special_in(self, value: Any) -> bool:
        """Whether a string in ``value`` (nested lists and mappings, keys too) spells one."""
        if isinstance(value, str):
            return self._spells_special(value)
        if isinstance(value, Mapping):
            return any(self._spells_special_in(k) or self._spells_special_in(v)
                       for k, v in value.items())
        if isinstance(value, (list, tuple)):
            return any(self._spells_special_in(v) for v in value)
        return False

    @functools.cached_property
    def _special_pattern(self) -> re.Pattern[str]:
        """Any of the special texts, the longest first."""
        texts = sorted(self._special_texts, key=len, reverse=True)
        return re.compile("|".join(map(re.escape, texts)) or "(?!)")

    @property
    def renders_tools(self) -> bool:
        """Whether the chat template lists tools and renders calls (it reads ``tools``)."""
        return "tools" in str(getattr(self.hf, "chat_template", None) or "")

    @functools.cached_property
    def _special_texts(self) -> tuple[str, ...]:
        """Texts the tokenizer turns into added (special or control) tokens."""
        return tuple(t for t in self.hf.get_added_vocab() if t)

    def _render_content_as_text(self, messages: list[dict[str, str]],
                                chat: _ChatOptions) -> list[int]:
        """Rendered with a placeholder per content (and per template variable's string that
        spells a control token); the template tokenized, those texts as text. Linear in the
        chat's size: one render, one split, two batched encodes."""
        nonce = uuid.uuid4().hex
        while nonce in repr(messages) or nonce in repr(chat.kwargs):
            nonce = uuid.uuid4().hex
        texts = [m["content"] for m in messages]

        def placeholder(text: str) -> str:
            texts.append(text)
            return f"\ue000{nonce}{len(texts) - 1}\ue001"

        def each(text: str) -> str:  # every control token's text apart: JSON-safe
            return self._special_pattern.sub(lambda m: placeholder(m.group(0)), text)

        marked = [{**_replace_strings(m, self._spells_special, each),
                   "role": m["role"], "content": f"\ue000{nonce}{i}\ue001"}
                  for i, m in enumerate(messages)]
        kwargs = _replace_strings(chat.kwargs, self._spells_special, each)
        rendered = self._render(marked, attrs.evolve(chat, kwargs=kwargs), tokenize=False)
        # Alternately the template's text and a text's index (a template may drop a
        # message, such as old reasoning turns).
        pieces = re.split(f"\ue000{nonce}(\\d+)\ue001", rendered)
        template, plain = self._encoders
        around = template.encode_batch(pieces[0::2], add_special_tokens=False)
        contents = plain.encode_batch([texts[int(i)] for i in pieces[1::2]],
                                      add_special_tokens=False)
        ids: list[int] = []
        for index, text in enumerate(around):
            ids += text.ids
            if index < len(contents):
                ids += contents[index].ids
        return ids

    @functools.cached_property
    def _encoders(self) -> tuple[Any, Any]:
        """Two copies of the tokenizer (special tokens parsed, and taken as text) that keep
        their setting: the shared one's switch would race between threads."""
        from tokenizers import Tokenizer as Backend

        spec = self.hf.backend_tokenizer.to_str()
        template, plain = Backend.from_str(spec), Backend.from_str(spec)
        for backend, as_text in ((template, False), (plain, True)):
            backend.no_truncation()
            backend.no_padding()
            backend.encode_special_tokens = as_text
        return template, plain

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; no clean-up of spaces, so decoding is additive at token boundaries."""
        text: str = self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens,
                                   clean_up_tokenization_spaces=False)
        return text

    def piece(self, token_id: int) -> tuple[str, bytes]:
        """One token's text and UTF-8 bytes, as logprobs show it (memoized). A byte-level
        token that is not valid UTF-8 alone (part of a character) has its exact bytes and
        the text ``bytes:\\xNN...``, as OpenAI's API spells such a token; where the bytes
        cannot be known (no byte-level vocabulary), the token's decoded text and its bytes."""
        known = self._pieces.get(token_id)
        if known is not None:
            return known
        raw = self._token_bytes(token_id)
        if raw is None:
            text = self.decode([token_id], skip_special_tokens=False)
            if self._space_marker and str(self.hf.convert_ids_to_tokens(token_id)).startswith(
                    self._space_marker) and not text.startswith(" "):
                text = " " + text  # decode drops a lone piece's leading space
            known = text, text.encode()
        else:
            try:
                known = raw.decode(), raw
            except UnicodeDecodeError:
                known = "bytes:" + "".join(f"\\x{b:02x}" for b in raw), raw
        self._pieces[token_id] = known
        return known

    def _token_bytes(self, token_id: int) -> bytes | None:
        """The bytes a token stands for, where the vocabulary says so: byte-level pieces
        (GPT-2's byte-to-character table) and byte-fallback pieces (``<0xE4>``)."""
        piece = self.hf.convert_ids_to_tokens(token_id)
        if not isinstance(piece, str):
            return None
        if token_id in self._added_ids:
            return piece.encode()
        if self._byte_level:
            try:
                return bytes(_BYTE_OF_CHAR[c] for c in piece)
            except KeyError:
                return None
        match = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)
        return bytes([int(match.group(1), 16)]) if match else None

    @functools.cached_property
    def special_ids(self) -> frozenset[int]:
        """The ids ``decode(..., skip_special_tokens=True)`` leaves out of the text."""
        return frozenset(i for i, t in getattr(self.hf, "added_tokens_decoder", {}).items()
                         if getattr(t, "special", False))

    @functools.cached_property
    def _added_ids(self) -> frozenset[int]:
        return frozenset(getattr(self.hf, "added_tokens_decoder", {}))

    @functools.cached_property
    def _decoders(self) -> list[dict[str, Any]]:
        """The backend's decoder steps (a Sequence unrolled)."""
        backend = getattr(self.hf, "backend_tokenizer", None)
        decoder = json.loads(backend.to_str()).get("decoder") if backend is not None else None
        if not decoder:
            return []
        return list(decoder.get("decoders") or [decoder])

    @functools.cached_property
    def _byte_level(self) -> bool:
        return any(d.get("type") == "ByteLevel" for d in self._decoders)

    @functools.cached_property
    def _space_marker(self) -> str | None:
        """SentencePiece's space character (``▁``) where the decoder turns it into a space."""
        for d in self._decoders:
            if d.get("type") == "Metaspace":
                return str(d.get("replacement", "\u2581"))
            if d.get("type") == "Replace" and d.get("content") == " ":
                pattern = d.get("pattern", {}).get("String")
                if isinstance(pattern, str) and pattern:
                    return pattern
        return None

    def detokenizer(
        self, params: SamplingParams, prompt_ids: Sequence[int] = ()
    ) -> IncrementalDetokenizer:
        """A fresh streaming detokenizer for one request's generated tokens."""
        return IncrementalDetokenizer(self, params, prompt_ids)


def _byte_table() -> dict[str, int]:
    """GPT-2's byte-level alphabet: each byte's printable stand-in character, inverted."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    chars = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + shifted)
            shifted += 1
    return {c: b for b, c in chars.items()}


_BYTE_OF_CHAR = _byte_table()


def _generation_eos_ids(path: Path) -> list[int]:
    config = path / "generation_config.json"
    if not config.is_file():
        return []
    eos = json.loads(config.read_text()).get("eos_token_id")
    if eos is None:
        return []
    return [int(eos)] if isinstance(eos, int) else [int(i) for i in eos]


class IncrementalDetokenizer:
    """One request's generated ids, pushed as they come, as text deltas. Invariant: the
    emitted text is a prefix of the final text (no split character, no stop string)."""

    def __init__(
        self, tokenizer: Tokenizer, params: SamplingParams, prompt_ids: Sequence[int] = ()
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = params.skip_special_tokens
        self._stops = params.stop
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._ids: list[int] = list(prompt_ids[-_CONTEXT_TOKENS:])  # context: never emitted
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._decoded = ""  # stable text: never changes once appended
        self._emitted = 0  # how much of _decoded the caller has been given
        self.stopped = False
        self.stop_reason: str | None = None

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return self._decoded[: self._emitted]

    def push(self, token_ids: Sequence[int]) -> str:
        """Add newly generated ids; the text delta they make safe to show (possibly "")."""
        if self.stopped:
            return ""
        self._ids.extend(token_ids)
        self._decoded += self._decode_window(final=False)
        return self._release(final=False)

    def finish(self) -> str:
        """Flush the text held back for incomplete characters or possible stop strings."""
        if self.stopped:
            return ""
        self._decoded += self._decode_window(final=True)
        return self._release(final=True)

    def _decode_window(self, final: bool) -> str:
        """New stable text of ids[read_offset:], decoded after the previous chunk."""
        if not final and self._read_offset == len(self._ids):
            return ""
        decode = self._tokenizer.decode
        prefix_text = decode(self._ids[self._prefix_offset : self._read_offset],
                             self._skip_special)
        window_text = decode(self._ids[self._prefix_offset :], self._skip_special)
        if not final and window_text.endswith(_REPLACEMENT):  # a character's bytes to come
            return ""
        if len(window_text) <= len(prefix_text):  # ids that decode to nothing: same window
            if final:
                self._read_offset = len(self._ids)
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return window_text[len(prefix_text) :]

    def _release(self, final: bool) -> str:
        """Emit what stop strings allow: cut at a match, else keep back a possible partial."""
        if self._stops:
            start = max(self._emitted - self._hold, 0)  # a new match ends in the new text
            matches = [(i, s) for s in self._stops if (i := self._decoded.find(s, start)) >= 0]
            if matches:
                cut, self.stop_reason = min(matches, key=lambda m: m[0])
                assert cut >= self._emitted, "a stop string began in text already emitted"
                self.stopped = True
                self._decoded = self._decoded[:cut]
                final = True
        end = len(self._decoded) if final else max(len(self._decoded) - self._hold, 0)
        if end <= self._emitted:
            return ""
        delta = self._decoded[self._emitted : end]
        self._emitted = end
        return delta
