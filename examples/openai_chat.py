"""Chat with a running ``asyncinfer serve`` through the official ``openai`` client: one
answer whole, then the same question streamed (greedy: the same text).

    asyncinfer serve --port 8000                                # another terminal
    python examples/openai_chat.py "What is the capital of France?"
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from attrs import frozen
from openai import OpenAI


@frozen
class Answer:
    text: str
    finish_reason: str | None
    completion_tokens: int | None   # from the usage the server reports
    chunks: int = 1                 # pieces it arrived in


def ask(client: OpenAI, model: str, messages: list[dict[str, str]], max_tokens: int,
        temperature: float) -> Answer:
    """The answer in one response."""
    response = client.chat.completions.create(
        model=model, messages=messages,
        max_tokens=max_tokens, temperature=temperature)
    choice = response.choices[0]
    return Answer(choice.message.content or "", choice.finish_reason,
                  response.usage.completion_tokens if response.usage else None)


def ask_streaming(client: OpenAI, model: str, messages: list[dict[str, str]],
                  max_tokens: int, temperature: float) -> Answer:
    """The answer as server-sent events, printed as they come (the last carries the usage)."""
    pieces: list[str] = []
    finish: str | None = None
    tokens: int | None = None
    stream = client.chat.completions.create(
        model=model, messages=messages,
        max_tokens=max_tokens, temperature=temperature, stream=True,
        stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        if choice.delta.content:
            pieces.append(choice.delta.content)
            print(choice.delta.content, end="", flush=True)
        finish = choice.finish_reason or finish
    print()
    return Answer("".join(pieces), finish, tokens, len(pieces))


def run(base_url: str, model: str | None, prompt: str, max_tokens: int = 64,
        temperature: float = 0.0, api_key: str = "none") -> tuple[Answer, Answer]:
    """Ask ``prompt`` whole, then streamed; both answers."""
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    model = model or client.models.list().data[0].id
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": prompt}]
    print(f"model {model} at {base_url}\n> {prompt}")
    whole = ask(client, model, messages, max_tokens, temperature)
    print(f"whole:    {whole.text}\n          ({whole.completion_tokens} tokens, "
          f"finish_reason={whole.finish_reason})")
    print("streamed: ", end="", flush=True)
    streamed = ask_streaming(client, model, messages, max_tokens, temperature)
    print(f"          ({streamed.completion_tokens} tokens in {streamed.chunks} chunks, "
          f"finish_reason={streamed.finish_reason})")
    return whole, streamed


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prompt", nargs="?", default="What is the capital of France?")
    parser.add_argument("--base-url", default=os.environ.get(
        "OPENAI_BASE_URL", "http://127.0.0.1:8000/v1"),
                        help="default: $OPENAI_BASE_URL, else http://127.0.0.1:8000/v1")
    parser.add_argument("--model", default=os.environ.get("OPENAI_MODEL"),
                        help="served model name (default: $OPENAI_MODEL, else the first "
                        "the server lists)")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "none"),
                        help="what `serve --api-key` expects (default: $OPENAI_API_KEY; "
                        "any value when it has none)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    args = parser.parse_args(argv)
    run(args.base_url, args.model, args.prompt, args.max_tokens, args.temperature,
        args.api_key)
    return 0


if __name__ == "__main__":
    sys.exit(main())
