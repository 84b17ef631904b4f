"""Stream text from ``AsyncEngine`` as it is generated: one request, then several at once
(their deltas interleave: they share the batches).

    python examples/stream_async_engine.py --model PATH --max-tokens 32 --dtype float32
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from typing import Any

from asyncinfer import AsyncEngine, RequestOutput, SamplingParams
from asyncinfer.options import add_engine_arguments, engine_options

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time,"]


async def stream_one(engine: AsyncEngine, prompt: str, params: SamplingParams
                     ) -> tuple[list[str], RequestOutput]:
    """Print one request's text as it arrives; its deltas and its output."""
    deltas: list[str] = []
    output = None
    print(prompt, end="", flush=True)
    async for delta in engine.stream(prompt, params):
        deltas.append(delta.text)
        print(delta.text, end="", flush=True)
        if delta.output is not None:  # the last delta
            output = delta.output
    print(f"  [{output.finish_reason if output else '?'}]")
    assert output is not None
    return deltas, output


async def stream_many(engine: AsyncEngine, prompts: Sequence[str], params: SamplingParams
                      ) -> tuple[list[int], list[RequestOutput]]:
    """Stream every prompt at once; the prompt index of each delta as it came, the outputs."""
    arrivals: list[int] = []

    async def one(i: int, prompt: str) -> RequestOutput:
        async for delta in engine.stream(prompt, params):
            arrivals.append(i)
            print(f"  [{i}] {delta.text!r}", flush=True)
            if delta.output is not None:
                return delta.output
        raise AssertionError("a stream ends with a delta that carries the output")

    outputs = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    return arrivals, list(outputs)


async def run(max_tokens: int = 24, prompts: Sequence[str] = PROMPTS, **options: Any
              ) -> tuple[tuple[list[str], RequestOutput], tuple[list[int], list[RequestOutput]]]:
    """One stream, then all ``prompts`` at once, greedy, ``max_tokens`` each (EOS ignored)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    async with AsyncEngine(**options) as engine:
        print("one stream:")
        single = await stream_one(engine, prompts[0], params)
        print(f"{len(prompts)} concurrent streams, deltas as they arrive:")
        many = await stream_many(engine, prompts, params)
        for i, out in enumerate(many[1]):
            print(f"[{i}] {out.prompt!r} -> {out.text!r} ({len(out.token_ids)} tokens, "
                  f"{out.finish_reason})")
    return single, many


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=24, help="per request (default: 24)")
    add_engine_arguments(parser, title="engine options (--model among them)")
    args = parser.parse_args(argv)
    asyncio.run(run(args.max_tokens, **engine_options(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
