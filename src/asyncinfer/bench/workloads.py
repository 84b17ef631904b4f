"""The named workloads of `asyncinfer bench serve` that mix kinds of request: long prompts
among streaming chats (``long-chat``), and many requests over a few long system prompts
(``prefix-share``). Each is planned from ``random.Random`` streams of its seed alone, so the
same seed gives the same requests at any rate."""

from __future__ import annotations

import argparse
import random
from typing import Any

from attrs import frozen

from asyncinfer.bench.plan import TOKEN_IDS, RequestSpec
from asyncinfer.bench.traffic import Uniform
from asyncinfer.errors import AsyncInferError


def _ids(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(*TOKEN_IDS) for _ in range(n))


# The defaults, sized for a 135M model on two CPU cores (a long prefill ~1 s).
CHAT_PROMPTS, CHAT_OUTPUTS = Uniform(32, 128), Uniform(64, 192)
LONG_PROMPTS, LONG_OUTPUTS = Uniform(1024, 2048), Uniform(16, 64)
QUESTIONS, ANSWERS = Uniform(16, 64), Uniform(32, 96)


@frozen
class LongChat:
    """Sarathi-Serve's setting: a seeded ``round(long_fraction * n)`` of the requests have long
    prompts and short outputs (prefill-heavy), the rest are short chats with longer outputs
    (streams a long prefill can stall). Long ones are marked ``long``."""

    long_fraction: float = 0.25
    short_input: Uniform = CHAT_PROMPTS
    short_output: Uniform = CHAT_OUTPUTS
    long_input: Uniform = LONG_PROMPTS
    long_output: Uniform = LONG_OUTPUTS

    def requests(self, num_requests: int, seed: int) -> list[RequestSpec]:
        chooser = random.Random(f"long-chat-kinds-{seed}")
        long = set(chooser.sample(range(num_requests), round(self.long_fraction * num_requests)))
        rng = random.Random(f"long-chat-{seed}")
        specs = []
        for i in range(num_requests):
            inputs, outputs = ((self.long_input, self.long_output) if i in long else
                               (self.short_input, self.short_output))
            prompt = _ids(rng, inputs.sample(rng))
            specs.append(RequestSpec(prompt, outputs.sample(rng), long=i in long))
        return specs

    def describe(self) -> dict[str, Any]:
        return {"workload": "long-chat", "long_fraction": self.long_fraction,
                "short_input": self.short_input.describe(),
                "short_output": self.short_output.describe(),
                "long_input": self.long_input.describe(),
                "long_output": self.long_output.describe()}


@frozen
class PrefixShare:
    """``groups`` system prompts of ``prefix_len`` ids each, the requests spread evenly over
    them in a seeded order (request i's group ``group_of(n, seed)[i]``), each its prompt's
    own ``question`` ids after it: a prefix cache's and a cache-aware policy's load."""

    groups: int = 4
    prefix_len: int = 1024
    question: Uniform = QUESTIONS
    output: Uniform = ANSWERS

    def group_of(self, num_requests: int, seed: int) -> list[int]:
        order = [i % self.groups for i in range(num_requests)]
        random.Random(f"prefix-share-order-{seed}").shuffle(order)
        return order

    def prefixes(self, seed: int) -> list[tuple[int, ...]]:
        rng = random.Random(f"prefix-share-prefixes-{seed}")
        return [_ids(rng, self.prefix_len) for _ in range(self.groups)]

    def requests(self, num_requests: int, seed: int) -> list[RequestSpec]:
        prefixes = self.prefixes(seed)
        rng = random.Random(f"prefix-share-{seed}")
        return [RequestSpec(prefixes[g] + _ids(rng, self.question.sample(rng)),
                            self.output.sample(rng))
                for g in self.group_of(num_requests, seed)]

    def describe(self) -> dict[str, Any]:
        return {"workload": "prefix-share", "groups": self.groups,
                "prefix_len": self.prefix_len, "question": self.question.describe(),
                "output": self.output.describe()}


Workload = LongChat | PrefixShare
NAMED_WORKLOADS = ("long-chat", "prefix-share")


def check_workload_flags(args: argparse.Namespace) -> None:
    """Refuse the flags the chosen workload does not read (AsyncInferError)."""
    given = {flag: value is not None for flag, value in (
        ("--input-len", args.input_len), ("--output-len", args.output_len),
        ("--long-factor", args.long_factor), ("--long-fraction", args.long_fraction),
        ("--long-input-range", args.long_input_range),
        ("--long-output-range", args.long_output_range),
        ("--prefix-groups", args.prefix_groups), ("--prefix-len", args.prefix_len),
        ("--max-input-len", args.max_input_len))}
    unread = {"long-chat": ("--input-len", "--output-len", "--long-factor", "--prefix-groups",
                            "--prefix-len"),
              "prefix-share": ("--input-len", "--output-len", "--long-factor",
                               "--long-fraction", "--long-input-range",
                               "--long-output-range", "--max-input-len")}.get(
        args.workload, ("--long-input-range", "--long-output-range"))
    if refused := [flag for flag in unread if given[flag]]:
        raise AsyncInferError(
            f"--workload {args.workload} does not read {' or '.join(refused)}; see "
            f"--help for the flags each workload reads")
    if args.workload == "prefix-share" and args.prefix_groups == 0:
        raise AsyncInferError("--workload prefix-share needs --prefix-groups of 1 or more")


def workload_from_flags(args: argparse.Namespace) -> Workload:
    """The ``long-chat`` or ``prefix-share`` workload the flags ask for (their defaults where
    a flag is not given); long prompts are cut to ``--max-input-len``."""
    if args.workload == "prefix-share":
        base = PrefixShare()
        return PrefixShare(
            base.groups if args.prefix_groups is None else args.prefix_groups,
            base.prefix_len if args.prefix_len is None else args.prefix_len,
            Uniform(*args.input_len_range) if args.input_len_range else base.question,
            Uniform(*args.output_len_range) if args.output_len_range else base.output)
    chat_base = LongChat()
    long_input = (Uniform(*args.long_input_range) if args.long_input_range
                  else chat_base.long_input)
    if args.max_input_len is not None:
        long_input = Uniform(min(long_input.lo, args.max_input_len),
                             min(long_input.hi, args.max_input_len))
    return LongChat(
        chat_base.long_fraction if args.long_fraction is None else args.long_fraction,
        Uniform(*args.input_len_range) if args.input_len_range else chat_base.short_input,
        Uniform(*args.output_len_range) if args.output_len_range else chat_base.short_output,
        long_input,
        Uniform(*args.long_output_range) if args.long_output_range else chat_base.long_output)
