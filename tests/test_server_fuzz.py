"""Schema-driven fuzzing of the server from its own ``/openapi.json``: valid and invalid
bodies for every generation route, and never a 5xx.

The server runs in a thread of its own (schemathesis calls it synchronously) over the stub
engine with the real SmolLM2 tokenizer, so validation, Unicode checks, tokenizing and the
chat template all meet what the fuzzer makes.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from hypothesis import HealthCheck, given, settings

from asyncinfer.server import create_app
from asyncinfer.server.options import ServerOptions
from tests.test_server import StubEngine

# Test extras (pyproject's [test]); a machine that runs only the GPU tests may lack them.
schemathesis = pytest.importorskip("schemathesis")
requests = pytest.importorskip("requests")

EXAMPLES = {"positive": 60, "negative": 40}


@pytest.fixture(scope="module")
def base_url(smollm2_dir: Path) -> Iterator[str]:
    from asyncinfer.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(smollm2_dir)
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    state: dict[str, Any] = {}

    async def start() -> None:
        engine = StubEngine(tokenizer=tokenizer, context_len=2048)
        options = ServerOptions(max_tokens_limit=32, default_max_tokens=8)
        runner = web.AppRunner(create_app(engine, options=options), handler_cancellation=True)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        state["runner"] = runner
        state["port"] = runner.addresses[0][1]

    def serve() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(start())
        ready.set()
        loop.run_forever()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert ready.wait(30)
    try:
        yield f"http://127.0.0.1:{state['port']}"
    finally:
        asyncio.run_coroutine_threadsafe(state["runner"].cleanup(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)


@pytest.mark.parametrize("mode", sorted(EXAMPLES))
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/generate"])
def test_fuzzed_bodies_never_get_a_5xx(base_url: str, path: str, mode: str) -> None:
    document = requests.get(f"{base_url}/openapi.json", timeout=10).json()
    schema = schemathesis.openapi.from_dict(document)
    [operation] = [op.ok() for op in schema.get_all_operations() if op.ok().path == path]
    statuses: list[int] = []

    @settings(max_examples=EXAMPLES[mode], deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=schemathesis.GenerationMode(mode)))
    def fuzz(case: Any) -> None:
        response = case.call(base_url=base_url, timeout=30)
        assert response.status_code < 500, (response.status_code, response.text[:500],
                                            case.body)
        if response.status_code >= 400:
            assert set(response.json()) == {"error"}
        statuses.append(response.status_code)

    fuzz()
    assert statuses, "the fuzzer sent nothing"
    if mode == "negative":
        assert any(400 <= s < 500 for s in statuses)
    else:  # the document tells the truth: what it allows, the server mostly accepts
        assert statuses.count(200) >= 0.8 * len(statuses), statuses
    assert requests.get(f"{base_url}/health", timeout=10).status_code == 200
