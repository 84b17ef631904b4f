"""What fleet gateways ask of a worker beyond serving: emptying the prefix cache
(``flush_cache``: nothing running loses a page or a token) and health that proves a token
can be generated (``/health_generate``: 503 while the engine core is stopped, 200 again
once it runs)."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

from tests.test_async_engine import greedy, tiny_engine
from tests.test_server_process import spawned, start_server

PROMPT = list(range(3, 60))


async def test_a_flush_empties_the_cache_of_what_nothing_holds(tiny_llama_dir: Path) -> None:
    async with tiny_engine(tiny_llama_dir) as engine:
        first = await engine.generate(PROMPT, greedy(8))
        await engine.generate(list(range(100, 140)), greedy(4))
        cached = engine.scheduler.kv.cached_pages
        assert cached > 0
        done = await engine.flush_cache()
        assert (done.freed_pages, done.held_pages) == (cached, 0)
        assert engine.scheduler.kv.cached_pages == 0
        assert engine.scheduler.kv.allocator.num_free == engine.runner.num_pages
        again = await engine.generate(PROMPT, greedy(8))
        assert again.cached_tokens == 0 and again.token_ids == first.token_ids
        engine.scheduler.check_invariants()


async def test_a_flush_beside_running_requests_keeps_what_they_hold(
        tiny_llama_dir: Path) -> None:
    """A request running on a cached prefix keeps it (held, not freed) and its tokens; the
    rest of the cache goes."""
    async with tiny_engine(tiny_llama_dir) as engine:
        alone = await engine.generate(PROMPT, greedy(40))
        await engine.generate(list(range(100, 140)), greedy(4))
        running = asyncio.ensure_future(engine.generate(PROMPT, greedy(40)))
        while not engine.scheduler.running:
            await asyncio.sleep(0)
        done = await engine.flush_cache()
        out = await running
        assert out.cached_tokens > 0 and out.token_ids == alone.token_ids
        assert done.freed_pages > 0 and done.held_pages >= out.cached_tokens // 4
        engine.scheduler.check_invariants()


async def test_health_generate_follows_a_stopped_core_and_flushes_lose_nothing(
        served_model: Path) -> None:
    import aiohttp

    proc, url = start_server(served_model, "--health-generate-timeout", "1.5")
    try:
        (core,) = spawned(proc.pid)
        async with aiohttp.ClientSession() as session:
            assert (await session.get(f"{url}/health_generate")).status == 200
            os.kill(core, signal.SIGSTOP)
            try:
                stalled = await session.get(f"{url}/health_generate")
                assert stalled.status == 503
                assert "no token within 1.5 s" in (await stalled.json())["status"]
            finally:
                os.kill(core, signal.SIGCONT)
            assert (await session.get(f"{url}/health_generate")).status == 200

            body = {"prompt": "Count: 1, 2,", "max_tokens": 24, "ignore_eos": True}
            requests = [asyncio.ensure_future(session.post(f"{url}/v1/completions",
                                                           json=body)) for _ in range(6)]
            flushes = []
            for _ in range(3):
                flushes.append(await session.post(f"{url}/flush_cache"))
                await asyncio.sleep(0.2)
            for resp in await asyncio.gather(*requests):
                assert resp.status == 200
                choice = (await resp.json())["choices"][0]
                assert choice["finish_reason"] == "length"
            for resp in flushes:
                assert resp.status == 200
                assert set(await resp.json()) == {"status", "freed_pages", "held_pages"}
            final = await (await session.post(f"{url}/flush_cache")).json()
            assert final["held_pages"] == 0
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)

