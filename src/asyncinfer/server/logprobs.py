"""Log-probabilities in OpenAI's shapes, from the engine's one ``TokenLogprob`` per position:
chat's ``logprobs.content`` entries (``token``, ``logprob``, ``bytes``, ``top_logprobs``)
and the legacy completions object (``tokens``, ``token_logprobs``, ``top_logprobs``,
``text_offset``). Each token is shown by ``Tokenizer.piece``: its text and exact bytes. See
docs/architecture.md, "Logprobs over HTTP"."""

from __future__ import annotations

import codecs
import math
from collections.abc import Collection, Sequence
from typing import Any, Protocol

from asyncinfer.core import TokenLogprob

# OpenAI's stand-in for a log-probability too small to show; JSON has no -Infinity.
LOWEST = -9999.0


class Pieces(Protocol):
    """What renders a token: its text and UTF-8 bytes (``Tokenizer.piece``)."""

    def piece(self, token_id: int) -> tuple[str, bytes]: ...


def shown(logprob: float) -> float:
    """A log-probability as JSON can carry it: -inf (and NaN) as :data:`LOWEST`."""
    return logprob if not math.isnan(logprob) and logprob > LOWEST else LOWEST


def chat_content(entries: Sequence[TokenLogprob], top: int,
                 pieces: Pieces) -> list[dict[str, Any]]:
    """Chat's ``logprobs.content``: per token its text, logprob, bytes and ``top`` most
    probable alternatives (exactly the top ``top``, the chosen token among them or not)."""

    def entry(token: int, logprob: float) -> dict[str, Any]:
        text, raw = pieces.piece(token)
        return {"token": text, "logprob": shown(logprob), "bytes": list(raw)}

    return [{**entry(e.token, e.logprob),
             "top_logprobs": [entry(t, lp) for t, lp in e.top[:top]]} for e in entries]


def empty_legacy() -> dict[str, list[Any]]:
    """A completions ``logprobs`` object with no tokens yet."""
    return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}


class LegacyLogprobs:
    """One choice's completions ``logprobs``, built part by part (the echoed prompt, then the
    output, or a stream's chunks): ``text_offset`` is each token's character offset in the
    choice's whole text, counted over the tokens' bytes as they decode, so a character split
    over tokens is counted once, at its last byte."""

    def __init__(self, top: int, pieces: Pieces) -> None:
        self.top = top
        self.pieces = pieces
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._chars = 0

    def add(self, token_ids: Sequence[int], entries: Sequence[TokenLogprob | None],
            zero_width: Collection[int] = ()) -> dict[str, list[Any]]:
        """The object of ``token_ids`` (each with its entry; None: a position without one,
        the prompt's first); a token in ``zero_width`` takes no room in the text (a special
        token the text leaves out)."""
        out = empty_legacy()
        for token, entry in zip(token_ids, entries):
            text, raw = self.pieces.piece(token)
            out["tokens"].append(text)
            out["text_offset"].append(self._chars)
            if token not in zero_width:
                self._chars += len(self._decoder.decode(raw))
            if entry is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            chosen = shown(entry.logprob)
            alternatives = {self.pieces.piece(t)[0]: shown(lp) for t, lp in entry.top[:self.top]}
            # The chosen token is always there: up to top + 1 entries, as OpenAI's.
            alternatives.setdefault(text, chosen)
            out["token_logprobs"].append(chosen)
            out["top_logprobs"].append(alternatives)
        return out


def joined(*parts: dict[str, list[Any]]) -> dict[str, list[Any]]:
    """Completions ``logprobs`` objects one after the other."""
    out = empty_legacy()
    for part in parts:
        for key, values in part.items():
            out[key].extend(values)
    return out
