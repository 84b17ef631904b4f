"""How long ``GET /health`` takes while a running server refuses a 15 MB prompt.

Sends ``{"prompt": "hello " * 2621440}`` (15.7 MB) to ``/v1/completions`` and to
``/v1/chat/completions``, and polls ``/health`` every 5 ms until the refusal comes back;
prints each refusal's status and time and the health latencies (median, max).

    asyncinfer serve --port 8000 &
    python benchmarks/health_under_big_prompt.py --url http://127.0.0.1:8000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

import aiohttp

TEXT = "hello " * 2621440


async def measure(session: aiohttp.ClientSession, url: str, path: str,
                  body: dict[str, Any]) -> dict[str, Any]:
    data = json.dumps(body).encode()  # encoded before the clock starts: the client's own
    start = time.perf_counter()       # encoding would stall the loop that polls /health
    big = asyncio.ensure_future(session.post(f"{url}{path}", data=data,
                                             headers={"Content-Type": "application/json"}))
    latencies = []
    while not big.done():
        t = time.perf_counter()
        async with session.get(f"{url}/health") as resp:
            assert resp.status == 200, resp.status
        latencies.append(time.perf_counter() - t)
        await asyncio.sleep(0.005)
    resp = await big
    refused_s = time.perf_counter() - start
    error = (await resp.json())["error"]
    return {"path": path, "status": resp.status, "code": error["code"],
            "refused_after_ms": round(refused_s * 1e3, 1), "health_polls": len(latencies),
            "health_median_ms": round(statistics.median(latencies) * 1e3, 2),
            "health_max_ms": round(max(latencies) * 1e3, 2)}


async def main(url: str) -> list[dict[str, Any]]:
    async with aiohttp.ClientSession() as session:
        return [
            await measure(session, url, "/v1/completions", {"prompt": TEXT, "max_tokens": 4}),
            await measure(session, url, "/v1/chat/completions",
                          {"messages": [{"role": "user", "content": TEXT}], "max_tokens": 4}),
        ]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    for row in asyncio.run(main(parser.parse_args().url)):
        print(json.dumps(row))
