"""KV-cache events in vLLM's schema: what the radix cache stores and evicts, for routers that
place requests by the prefixes each worker holds (llm-d's precise prefix scorer, Dynamo's KV
router). The structs are written from vLLM's published schema (``vllm.distributed.
kv_events``, vLLM 0.26 and later: each event a map tagged ``type``, the batch an array);
tests/test_kv_events.py checks the bytes against ones vLLM's own classes encoded. See
docs/architecture.md, 'KV-cache events'."""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Sequence

import msgspec

MEDIUM = "CPU"   # or "GPU": where a cached page lives, as vLLM names it


class BlockStored(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Pages (vLLM's blocks) cached: ``token_ids`` holds ``block_size`` tokens per hash;
    ``parent_block_hash`` is the page before the first (None: they start the sequence)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Pages no longer cached."""

    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Nothing is cached any more (at start, and after a flush that freed everything)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One round's events: ``ts`` (seconds since the epoch), the events, and the
    data-parallel replica that sent them."""

    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


encode_batch = msgspec.msgpack.Encoder().encode
decode_batch = msgspec.msgpack.Decoder(KVEventBatch).decode


def _sha256(value: object) -> bytes:
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


NONE_HASH = _sha256(os.environ.get("PYTHONHASHSEED", "vllm-none-hash"))
"""The parent of a sequence's first page, seeded as vLLM seeds its own."""


def page_hash(parent: bytes | None, tokens: Sequence[int]) -> bytes:
    """A page's hash from its parent's and its tokens: vLLM's default prefix-caching hash
    (sha256 over the pickled ``(parent, tokens, None)``), so a page holding the same tokens
    after the same prefix has the same hash here as in vLLM."""
    return _sha256((parent or NONE_HASH, tuple(tokens), None))


def external(digest: bytes) -> int:
    """A hash as events carry it: its last 8 bytes as an unsigned integer (vLLM's default)."""
    return int.from_bytes(digest, "big") & 0xFFFF_FFFF_FFFF_FFFF
