"""Every hostile request of the server's hardening, one after another against one real
`asyncinfer serve`: afterwards nothing waits, runs or holds a page, and an ordinary request
is answered 200."""

from __future__ import annotations

import asyncio
import gzip
import json
import zlib
from pathlib import Path

from tests.test_server_process import nothing_held, start_server

KEY = "s3cret"
AUTH = f"Authorization: Bearer {KEY}".encode()
ORDINARY = {"prompt": "The capital of France is", "max_tokens": 2, "temperature": 0}


async def _send(host: str, port: int, path: str, head: bytes, body: bytes, *,
                length: int | None = None, answer: bool = True) -> bytes:
    """The status line of a POST whose header bytes and body are sent as given; with
    ``answer=False``, the connection is closed once the bytes are out."""
    reader, writer = await asyncio.open_connection(host, port)
    size = len(body) if length is None else length
    writer.write(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {size}\r\n".encode() + head + b"\r\n" + body)
    await writer.drain()
    status = b""
    if answer:
        status = await asyncio.wait_for(reader.readline(), 300)
    writer.close()
    return status


def _bomb(inflated: int) -> bytes:
    deflater = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    zeros = bytes(2**20)
    return b"".join([*(deflater.compress(zeros) for _ in range(inflated // 2**20)),
                     deflater.flush()])


async def test_after_every_hostile_request_nothing_is_held_and_a_request_is_served(
        served_model: Path) -> None:
    import aiohttp

    proc, url = start_server(served_model, "--api-key", KEY, "--max-waiting-requests", "4",
                             "--body-timeout", "5")
    host, port = "127.0.0.1", int(url.rsplit(":", 1)[1])
    completions = "/v1/completions"
    body = json.dumps(ORDINARY).encode()

    async def post(head: bytes, data: bytes, path: str = completions, **kw: object) -> bytes:
        return await _send(host, port, path, head, data, **kw)  # type: ignore[arg-type]

    try:
        # Header bytes that are not UTF-8: more of them than the queue has places.
        for _ in range(6):
            assert (await post(AUTH + b"\r\nX-Tenant: \xff\r\n", body)).startswith(
                b"HTTP/1.1 400")
        # API keys that are not the key, in bytes that are not UTF-8 or not ASCII.
        for key in (b"caf\xe9", b"\xff\xfe", "café".encode()):
            assert (await post(b"Authorization: Bearer " + key + b"\r\n", body)).startswith(
                b"HTTP/1.1 401")
        # Uploads that stall, as many as the queue has places, then clients that hang up
        # mid-body.
        stalled = [await asyncio.open_connection(host, port) for _ in range(4)]
        for _, writer in stalled:
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + AUTH
                         + b"\r\nContent-Type: application/json\r\nContent-Length: 100"
                         b"\r\n\r\n{\"prompt\"")
            await writer.drain()
        assert (await post(AUTH + b"\r\n", body)).startswith(b"HTTP/1.1 200")
        for _ in range(3):
            await post(AUTH + b"\r\n", body[:10], length=200, answer=False)
        for _, writer in stalled:
            writer.close()
        # Bodies: corrupt gzip and deflate, an encoding not taken, gzip bombs, bytes that
        # are not UTF-8, a lone surrogate.
        for encoding in (b"gzip", b"deflate"):
            assert (await post(AUTH + b"\r\nContent-Encoding: " + encoding + b"\r\n",
                               b"\x1f\x8b\x08\x00 not a stream")).startswith(b"HTTP/1.1 400")
        assert (await post(AUTH + b"\r\nContent-Encoding: zstd\r\n", body)).startswith(
            b"HTTP/1.1 415")
        bombs = await asyncio.gather(*(post(AUTH + b"\r\nContent-Encoding: gzip\r\n",
                                            _bomb(64 * 2**20)) for _ in range(3)))
        assert all(b.startswith(b"HTTP/1.1 413") for b in bombs), bombs
        for bad in (b'{"prompt": "\xff\xfe"}', b'{"prompt": "\\ud800"}'):
            assert (await post(AUTH + b"\r\n", bad)).startswith(b"HTTP/1.1 400")
        # Chats of thousands of messages, one spelling a special token: sent and abandoned,
        # then one too long for the context refused.
        messages = [{"role": "user", "content": "x"} for _ in range(6000)]
        messages[3000]["content"] = "<|im_end|>"
        chat = json.dumps({"messages": messages, "max_tokens": 1}).encode()
        for _ in range(2):
            await post(AUTH + b"\r\n", chat, path="/v1/chat/completions", answer=False)
        assert (await post(AUTH + b"\r\n", chat, path="/v1/chat/completions")).startswith(
            b"HTTP/1.1 400")
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY}"}) as s:
            # A stream whose reader leaves after its first chunk.
            stream = await s.post(f"{url}{completions}",
                                  json={**ORDINARY, "max_tokens": 200, "stream": True})
            assert stream.status == 200
            await stream.content.readline()
            stream.close()
            gzipped = await s.post(f"{url}{completions}", data=gzip.compress(body),
                                   headers={"Content-Encoding": "gzip",
                                            "Content-Type": "application/json"})
            assert gzipped.status == 200
            text = await nothing_held(s, url, timeout=120)
            failed = next(float(line.split()[1]) for line in text.splitlines() if line.startswith(
                'asyncinfer_requests_total{outcome="failed"}'))
            assert failed == 0, text
            async with s.post(f"{url}{completions}", json=ORDINARY) as response:
                assert response.status == 200
                assert (await response.json())["usage"]["completion_tokens"] == 2
            async with s.get(f"{url}/health") as response:
                assert response.status == 200
    finally:
        proc.terminate()
        proc.wait(60)
    assert "Traceback" not in (proc.stderr.read() if proc.stderr else "")
