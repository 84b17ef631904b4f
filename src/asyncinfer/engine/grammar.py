"""Structured output through xgrammar: grammars compiled once per text (off the event loop:
see ``AsyncEngine.submit``) and, per constrained row, a matcher whose next-token bitmask
masks the row's logits before sampling. Rows without a constraint are not touched."""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import torch
from torch import Tensor

from asyncinfer.core import Batch
from asyncinfer.errors import InvalidRequestError
from asyncinfer.kernels.cpu import NativeKernels
from asyncinfer.params import SamplingParams

logger = logging.getLogger(__name__)

CACHED_GRAMMARS = 256   # compiled grammars kept, the least recently used dropped first


def _xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError as exc:  # a machine without it still serves the rest
        raise InvalidRequestError("structured output needs the xgrammar package "
                                  "(pip install xgrammar)",
                                  param="structured") from exc
    return xgrammar


def choice_grammar(text: str, field_name: str) -> str:
    """The EBNF grammar of one of the strings of the JSON list ``text``."""
    try:
        choices = json.loads(text)
    except ValueError:
        choices = None
    if not (isinstance(choices, list) and choices
            and all(isinstance(c, str) and c for c in choices)):
        raise InvalidRequestError(f"{field_name} must be a non-empty list of non-empty "
                                  f"strings, got {text:.80}", param=field_name)
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


@attrs.define
class _Row:
    """One constrained request's matcher on one token-pool row."""

    params: SamplingParams   # held: its id names the request while the row is its
    matcher: Any
    accepted: int = 0        # output tokens the matcher has taken
    broken: bool = False     # a token it refused (never masked out here): EOS only, after


@attrs.define
class _Pending:
    """Sampled tokens of constrained rows not yet on the host (CUDA: copied, then ``done``)."""

    rows: list[int]
    tokens: Tensor
    done: Any = None


class Grammars:
    """Compiles constraints for the model at ``model_dir`` and masks constrained rows (with
    ``native``'s kernel where it takes the logits: xgrammar's CPU kernel tests bit by bit)."""

    def __init__(self, model_dir: Path, vocab_size: int,
                 native: NativeKernels | None = None) -> None:
        self.model_dir, self.vocab_size = model_dir, vocab_size
        self.native = native
        self.stop_ids: frozenset[int] = frozenset()   # set by the engine: what ends a request
        self._lock = threading.Lock()
        self._compiler: Any = None
        self._compiled: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._rows: dict[int, _Row] = {}
        self._pending: list[_Pending] = []

    def _compiler_here(self) -> Any:
        with self._lock:
            if self._compiler is None:
                xgr = _xgrammar()
                from asyncinfer.tokenizer import Tokenizer
                try:
                    tokenizer = Tokenizer.from_pretrained(self.model_dir)
                except Exception as exc:
                    raise InvalidRequestError(
                        f"structured output needs the model's tokenizer, which did not load "
                        f"from {self.model_dir}: {exc}", param="structured") from exc
                info = xgr.TokenizerInfo.from_huggingface(
                    tokenizer.hf, vocab_size=self.vocab_size,
                    stop_token_ids=sorted(self.stop_ids) or None)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
            return self._compiler

    def compiled(self, spec: tuple[str, str]) -> bool:
        """Whether ``spec`` is compiled already (its request can be queued at once)."""
        with self._lock:
            return spec in self._compiled

    def compile(self, spec: tuple[str, str], field_name: str = "structured") -> Any:
        """The compiled grammar of ``spec`` (cached by its text); one that does not compile:
        InvalidRequestError naming ``field_name``. Slow for a large schema: call it off
        the event loop."""
        with self._lock:
            if spec in self._compiled:
                self._compiled.move_to_end(spec)
                return self._compiled[spec]
        compiler = self._compiler_here()
        kind, text = spec
        try:
            if kind == "json":
                grammar = compiler.compile_json_schema(text, any_whitespace=False)
            elif kind == "json_object":  # OpenAI's: an object, not any JSON value
                grammar = compiler.compile_json_schema('{"type": "object"}',
                                                       any_whitespace=False)
            elif kind == "regex":
                grammar = compiler.compile_regex(text)
            elif kind == "choice":
                grammar = compiler.compile_grammar(choice_grammar(text, field_name))
            elif kind == "structural_tag":  # xgrammar's format: tags, sequences, schemas
                grammar = compiler.compile_structural_tag(text)
            else:
                grammar = compiler.compile_grammar(text)
        except InvalidRequestError:
            raise
        except Exception as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise InvalidRequestError(f"{field_name} does not compile ({kind}): {first:.300}",
                                      param=field_name) from exc
        with self._lock:
            self._compiled[spec] = grammar
            while len(self._compiled) > CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        return grammar

    def constrained(self, batch: Batch) -> list[int]:
        """The batch indices of rows that sample under a constraint."""
        return [i for i, (p, s) in enumerate(zip(batch.params, batch.sample))
                if s and p.structured is not None]

    def mask(self, logits: Tensor, batch: Batch, rows: Sequence[int],
             token_pool: Tensor, raw: bool) -> Tensor:
        """``logits`` with each row of ``rows`` limited to the tokens its grammar allows
        next (only its stop ids once it is complete); a copy when ``raw`` (the model's own
        logits, which logprobs read)."""
        xgr = _xgrammar()
        self.settle()
        vocab = logits.shape[-1]
        bitmask = xgr.allocate_token_bitmask(batch.size, vocab)  # all allowed
        for i in rows:
            row = self._row(batch, i, token_pool)
            if row.broken or row.matcher.is_terminated():
                bitmask[i].zero_()
                for t in self.stop_ids:
                    if t < vocab:
                        bitmask[i, t // 32] |= _bit(t % 32)
            else:
                row.matcher.fill_next_token_bitmask(bitmask, i)
        out = logits.clone() if raw else logits
        # Set what a row's mask forbids to -inf, in place: our CPU kernel, else xgrammar's.
        if self.native is not None and self.native.masks(out):
            self.native.mask_rows(out, bitmask, list(rows), vocab)
        else:
            xgr.apply_token_bitmask_inplace(out, bitmask.to(logits.device), vocab_size=vocab,
                                            indices=list(rows))
        return out

    def record(self, tokens: Tensor, batch: Batch, rows: Sequence[int],
               stream: Any = None) -> None:
        """Feed each constrained row its sampled token: at once on the CPU; on CUDA once
        the copy is on the host (the next mask waits for it; the loop does not)."""
        pool_rows = [batch.rows[i] for i in rows]
        index = torch.tensor(list(rows), dtype=torch.int64, device=tokens.device)
        chosen = tokens[index]
        if stream is None:
            self._accept(pool_rows, chosen.tolist())
            return
        host = torch.empty(chosen.shape, dtype=chosen.dtype, pin_memory=True)
        host.copy_(chosen, non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
        self._pending.append(_Pending(pool_rows, host, done))

    def settle(self) -> None:
        """Feed the matchers every token still on its way to the host."""
        pending, self._pending = self._pending, []
        for item in pending:
            if item.done is not None:
                item.done.synchronize()
            self._accept(item.rows, item.tokens.tolist())

    def _accept(self, pool_rows: Sequence[int], tokens: Sequence[int]) -> None:
        for pool_row, token in zip(pool_rows, tokens):
            row = self._rows.get(pool_row)
            if row is None:
                continue
            if (not row.broken and not row.matcher.is_terminated()
                    and not row.matcher.accept_token(token)):
                logger.warning("a constrained row sampled token %d its grammar refuses; "
                               "it may only stop now", token)
                row.broken = True
            row.accepted += 1

    def _row(self, batch: Batch, i: int, token_pool: Tensor) -> _Row:
        """Row ``i``'s matcher, made (and fed the row's tokens so far) when the row has none
        for this request or is out of step (preempted and recomputed elsewhere)."""
        pool_row, params, step = batch.rows[i], batch.params[i], batch.steps[i]
        row = self._rows.get(pool_row)
        if row is not None and row.params is params and row.accepted == step:
            return row
        assert params.structured is not None
        xgr = _xgrammar()
        grammar = self.compile(params.structured, params.structured_field)
        row = _Row(params, xgr.GrammarMatcher(grammar,
                                               override_stop_tokens=sorted(self.stop_ids)
                                               or None))
        self._rows[pool_row] = row
        if step:
            start = batch.prompt_lens[i]
            self._accept([pool_row], token_pool[pool_row, start:start + step].tolist())
        return row


def _bit(k: int) -> int:
    """Bit ``k`` of an int32 word, as the signed value xgrammar's bitmask holds."""
    return -(1 << 31) if k == 31 else 1 << k

