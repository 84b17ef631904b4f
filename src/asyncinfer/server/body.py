"""A request body's bytes, decoded from its ``Content-Encoding`` within the body limit.

The app turns aiohttp's own inflation off (it runs on the event loop and, after a 413,
keeps inflating what lingers): a compressed body is read whole as sent (at most the limit)
and inflated in a worker thread, stopping one byte past the limit. See
docs/architecture.md, "Compressed bodies".
"""

from __future__ import annotations

import asyncio
import zlib

from aiohttp import web

from asyncinfer.server.errors import APIError, bad_request

ENCODINGS = ("identity", "gzip", "x-gzip", "deflate")


async def decoded(request: web.Request, raw: bytes, limit: int) -> bytes:
    """``raw`` (the body as sent) decoded: 415 for an encoding not taken, 400 for a corrupt
    stream, 413 once more than ``limit`` bytes would come out."""
    encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding in ("", "identity"):
        return raw
    if encoding not in ENCODINGS:
        raise APIError(415, f"Content-Encoding {encoding!r} is not supported; send the body "
                            f"as {', '.join(ENCODINGS)}", param="Content-Encoding",
                       code="unsupported_encoding")
    return await asyncio.get_running_loop().run_in_executor(None, inflate, raw, encoding,
                                                            limit)


def inflate(data: bytes, encoding: str, limit: int) -> bytes:
    """``data`` inflated (gzip, one member or more, or deflate with or without its zlib
    header); never more than ``limit + 1`` bytes are made."""
    if encoding == "deflate":
        wbits = zlib.MAX_WBITS if data[:1] and data[0] & 0xF == 8 else -zlib.MAX_WBITS
    else:
        wbits = 16 + zlib.MAX_WBITS
    parts: list[bytes] = []
    made = 0
    rest = data
    while True:
        inflater = zlib.decompressobj(wbits)
        try:
            parts.append(inflater.decompress(rest, limit + 1 - made))
        except zlib.error as exc:
            raise bad_request(f"the request body could not be read: its {encoding} stream "
                              f"is corrupt ({exc})") from None
        made += len(parts[-1])
        if made > limit:
            raise APIError(413, f"the request body inflates to more than the limit of "
                                f"{limit} bytes", code="request_too_large")
        if not inflater.eof:
            raise bad_request(f"the request body could not be read: its {encoding} stream "
                              "ends early")
        rest = inflater.unused_data
        if wbits != 16 + zlib.MAX_WBITS or not rest:
            return parts[0] if len(parts) == 1 else b"".join(parts)
