"""Logprobs of sampled tokens and of prompt tokens, against transformers' log-softmax of its
logits on the same weights (float32, within 1e-4): under batching with requests that ask for
none, chunked prefill, a prefix-cache hit, overlap on and off, two tensor-parallel ranks,
through AsyncEngine's stream and the server's /generate."""

from __future__ import annotations

import json
import random
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncinfer.api import LLM, AsyncEngine
from asyncinfer.core import TokenLogprob
from asyncinfer.errors import InvalidRequestError
from asyncinfer.outputs import RequestOutput
from asyncinfer.params import SamplingParams
from tests.hf_reference import load_hf

TOL = 1e-4
OPTIONS: dict[str, Any] = {"dtype": "float32", "page_size": 4, "max_running_requests": 8,
                           "num_pages": 256, "max_seq_len": 128}


def tiny_llm(model_dir: Path, **options: Any) -> LLM:
    return LLM(str(model_dir), skip_tokenizer_init=True, **{**OPTIONS, **options})


_HF: dict[str, torch.nn.Module] = {}


def hf_logprobs(model_dir: Path, sequence: Sequence[int]) -> torch.Tensor:
    """transformers' float32 log-softmax of its logits at every position of ``sequence``."""
    key = str(model_dir)
    if key not in _HF:
        _HF[key] = load_hf(model_dir)
    with torch.inference_mode():
        logits = _HF[key](torch.tensor([list(sequence)])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def check_entry(entry: TokenLogprob, expected: torch.Tensor, token: int, k: int) -> None:
    """``entry`` is ``token``'s logprob under ``expected`` [V], with its top ``k``."""
    assert entry.token == token
    assert abs(entry.logprob - float(expected[token])) <= TOL
    assert len(entry.top) == k
    if k:
        top = expected.topk(k)
        assert [t for t, _ in entry.top] == top.indices.tolist()
        assert max(abs(v - float(e)) for (_, v), e in zip(entry.top, top.values)) <= TOL


def check_sampled(model_dir: Path, prompt: list[int], out: RequestOutput, k: int) -> None:
    """Every output token's logprob and top ``k`` equal transformers' at its position."""
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids) > 0
    reference = hf_logprobs(model_dir, prompt + out.token_ids)
    for t, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        check_entry(entry, reference[len(prompt) - 1 + t], token, k)


def check_prompt(model_dir: Path, prompt: list[int], out: RequestOutput, k: int) -> None:
    """One entry per prompt token, the first None, each transformers' at the position before."""
    entries = out.prompt_logprobs
    assert entries is not None and len(entries) == len(prompt) and entries[0] is None
    reference = hf_logprobs(model_dir, prompt)
    for i in range(1, len(prompt)):
        entry = entries[i]
        assert entry is not None
        check_entry(entry, reference[i - 1], prompt[i], k)


def same_entries(got: Sequence[TokenLogprob | None] | None,
                 want: Sequence[TokenLogprob | None] | None) -> None:
    """The same tokens and alternatives, values within float32 rounding of another run."""
    assert (got is None) == (want is None)
    for a, b in zip(got or [], want or [], strict=True):
        assert (a is None) == (b is None)
        if a is not None and b is not None:
            assert a.token == b.token and [t for t, _ in a.top] == [t for t, _ in b.top]
            assert abs(a.logprob - b.logprob) <= 1e-5
            assert all(abs(x - y) <= 1e-5 for (_, x), (_, y) in zip(a.top, b.top))


def prompts(seed: int, count: int, low: int = 2, high: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randrange(low, high))]
            for _ in range(count)]


def greedy(n: int, **fields: Any) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **fields)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_sampled_logprobs_equal_transformers_in_a_mixed_batch(tiny_llama_dir: Path,
                                                              overlap: bool) -> None:
    """Greedy and seeded-sampled requests asking for 0, 1 or 5 alternatives share batches with
    requests asking for none, whose tokens stay what they are without the others; sampled
    at temperature 1.5 the logprobs are still the raw distribution's."""
    batch = prompts(1, 8)
    plain = [greedy(6) if i % 2 else SamplingParams(max_tokens=6, temperature=1.5, seed=i,
                                                    ignore_eos=True) for i in range(8)]
    asks = [p.replace(logprobs=(0, 1, 5)[i % 3]) if i % 4 != 3 else p
            for i, p in enumerate(plain)]
    llm = tiny_llm(tiny_llama_dir, overlap=overlap)
    without = llm.generate(batch, plain, use_tqdm=False)
    outputs = llm.generate(batch, asks, use_tqdm=False)
    llm.close()
    assert [o.token_ids for o in outputs] == [o.token_ids for o in without]
    for prompt, params, out in zip(batch, asks, outputs):
        if params.logprobs is None:
            assert out.logprobs is None
        else:
            check_sampled(tiny_llama_dir, prompt, out, params.logprobs)
        assert out.prompt_logprobs is None


@pytest.mark.parametrize("policy", ["prefill_first", "stall_free"])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_prompt_logprobs_stitch_chunks_in_order(tiny_llama_dir: Path, overlap: bool,
                                                policy: str) -> None:
    """Prompts of up to 60 tokens prefilled in chunks of at most 8 tokens, batched with
    requests that score nothing (stall_free: chunks beside decodes, in mixed batches):
    every prompt position is transformers'."""
    batch = [*prompts(2, 6, low=9, high=60), [7]]
    params = [greedy(3, prompt_logprobs=(0, 2, 20)[i % 3], logprobs=i % 2 or None)
              if i % 3 != 1 else greedy(3) for i in range(len(batch))]
    llm = tiny_llm(tiny_llama_dir, overlap=overlap, max_extend_tokens=8, policy=policy)
    alone = [o.token_ids for o in llm.generate(batch, [greedy(3)] * len(batch),
                                               use_tqdm=False)]
    mixed = llm.engine.stats().batches_mixed
    outputs = llm.generate(batch, params, use_tqdm=False)
    assert (llm.engine.stats().batches_mixed > mixed) == (policy == "stall_free")
    llm.close()
    assert [o.token_ids for o in outputs] == alone
    for prompt, p, out in zip(batch, params, outputs):
        if p.prompt_logprobs is None:
            assert out.prompt_logprobs is None
            continue
        check_prompt(tiny_llama_dir, prompt, out, p.prompt_logprobs)
        if p.logprobs is not None:
            check_sampled(tiny_llama_dir, prompt, out, p.logprobs)


def test_prompt_logprobs_skip_a_prefix_cache_hit(tiny_llama_dir: Path) -> None:
    """A prompt the radix cache holds: a request scoring it computes it whole (no cached
    tokens) and gets every position; one that does not score it still hits the cache."""
    prompt = prompts(3, 1, low=30, high=31)[0]
    llm = tiny_llm(tiny_llama_dir, cache_type="radix")
    first = llm.generate([prompt], greedy(4), use_tqdm=False)[0]
    assert first.cached_tokens == 0
    again = llm.generate([prompt], greedy(4), use_tqdm=False)[0]
    assert again.cached_tokens > 0
    scored = llm.generate([prompt], greedy(4, prompt_logprobs=3), use_tqdm=False)[0]
    llm.close()
    assert scored.cached_tokens == 0
    assert scored.token_ids == first.token_ids
    check_prompt(tiny_llama_dir, prompt, scored, 3)


def test_max_tokens_0_scores_the_prompt_and_samples_nothing(tiny_llama_dir: Path) -> None:
    """max_tokens 0 with prompt_logprobs: prefill only, finish "length", no token; with
    requests that decode alongside, whose tokens are unchanged."""
    batch = prompts(4, 4, low=5, high=30)
    params = [SamplingParams(max_tokens=0, prompt_logprobs=1), greedy(5),
              SamplingParams(max_tokens=0, prompt_logprobs=0), greedy(5)]
    llm = tiny_llm(tiny_llama_dir, max_extend_tokens=16)
    alone = [o.token_ids for o in llm.generate(batch, greedy(5), use_tqdm=False)]
    outputs = llm.generate(batch, params, use_tqdm=False)
    llm.close()
    for i in (0, 2):
        assert outputs[i].finish_reason == "length" and outputs[i].token_ids == []
        check_prompt(tiny_llama_dir, batch[i], outputs[i], params[i].prompt_logprobs or 0)
    assert [outputs[1].token_ids, outputs[3].token_ids] == [alone[1], alone[3]]


def test_preempted_requests_keep_their_logprobs_and_send_the_prompts_once(
        tiny_llama_dir: Path) -> None:
    """A scoring request preempted mid-prompt recomputes it and keeps what it had; one
    preempted after its first token sends its prompt logprobs once; both equal
    transformers'."""
    llm = tiny_llm(tiny_llama_dir, max_extend_tokens=8)
    sched = llm.scheduler
    batch = prompts(8, 2, low=30, high=31)
    params = greedy(4, prompt_logprobs=2, logprobs=1)
    for uid, prompt in enumerate(batch):
        sched.add_request(uid, prompt, params)
    events = sched.step()           # request 0's first chunk
    assert sched.preempt(0)         # mid-prompt
    while not any(e.uid == 1 and e.token is not None for e in events):
        events += sched.step()
    assert sched.preempt(1)         # after its first token
    while sched.has_work:
        events += sched.step()
    llm.close()
    for uid, prompt in enumerate(batch):
        mine = [e for e in events if e.uid == uid]
        assert mine[-1].finish_reason == "length"
        sent = [e.prompt_logprobs for e in mine if e.prompt_logprobs is not None]
        assert len(sent) == 1
        out = RequestOutput(uid, None, prompt, "", [e.token for e in mine if e.token is not None],
                            "length", logprobs=[e.logprob for e in mine if e.logprob],
                            prompt_logprobs=list(sent[0]))
        assert len(out.token_ids) == 4
        check_sampled(tiny_llama_dir, prompt, out, 1)
        check_prompt(tiny_llama_dir, prompt, out, 2)


def test_bad_logprob_fields_are_refused_by_name() -> None:
    for name in ("logprobs", "prompt_logprobs"):
        with pytest.raises(InvalidRequestError, match=name) as info:
            SamplingParams(**{name: 21})
        assert info.value.param == name
    with pytest.raises(InvalidRequestError, match="prompt_logprobs") as info:
        SamplingParams(max_tokens=0)
    assert info.value.param == "max_tokens"
    with pytest.raises(InvalidRequestError):
        SamplingParams(max_tokens=-1, prompt_logprobs=1)


def test_two_tensor_parallel_ranks_report_one_ranks_logprobs(tiny_llama_dir: Path) -> None:
    batch = prompts(5, 4)
    params = [greedy(4, logprobs=3, prompt_logprobs=2 if i % 2 else None) for i in range(4)]
    llm = tiny_llm(tiny_llama_dir, tensor_parallel_size=2, max_extend_tokens=16)
    outputs = llm.generate(batch, params, use_tqdm=False)
    llm.close()
    for prompt, p, out in zip(batch, params, outputs):
        check_sampled(tiny_llama_dir, prompt, out, 3)
        if p.prompt_logprobs is not None:
            check_prompt(tiny_llama_dir, prompt, out, 2)


async def test_stream_deltas_carry_logprobs_aligned_with_their_tokens(
        tiny_llama_dir: Path) -> None:
    prompt = prompts(6, 1, low=12, high=13)[0]
    async with AsyncEngine(str(tiny_llama_dir), skip_tokenizer_init=True,
                           **{**OPTIONS, "max_extend_tokens": 5}) as engine:
        deltas = [d async for d in engine.stream(prompt, greedy(7, logprobs=2,
                                                                prompt_logprobs=1))]
        plain = [d async for d in engine.stream(prompt, greedy(7))]
    out = deltas[-1].output
    assert out is not None and out.logprobs is not None
    for delta in deltas:
        assert delta.logprobs is not None
        assert [e.token for e in delta.logprobs] == delta.token_ids
    assert [e for d in deltas for e in d.logprobs or []] == out.logprobs
    assert [d.prompt_logprobs is not None for d in deltas] == [True] + [False] * (
        len(deltas) - 1)
    assert deltas[0].prompt_logprobs == out.prompt_logprobs
    check_sampled(tiny_llama_dir, prompt, out, 2)
    check_prompt(tiny_llama_dir, prompt, out, 1)
    assert all(d.logprobs is None and d.prompt_logprobs is None for d in plain)
    assert plain[-1].output is not None and plain[-1].output.logprobs is None


def _post(url: str, body: dict[str, Any]) -> tuple[int, bytes]:
    request = urllib.request.Request(url, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _entries(raw: list[dict[str, Any]]) -> list[TokenLogprob]:
    return [TokenLogprob(e["token_id"], e["logprob"],
                         tuple((int(t), float(v)) for t, v in e["top_logprobs"])) for e in raw]


def test_generate_route_returns_logprobs_whole_and_streamed(tiny_chat_llama_dir: Path) -> None:
    """/generate takes logprobs and prompt_logprobs in sampling_params and answers them
    (streamed: per chunk); max_tokens 0 scores; bad values are a 400 naming the field."""
    from tests.test_server_process import start_server

    proc, url = start_server(tiny_chat_llama_dir)
    try:
        ids = prompts(7, 1, low=10, high=11)[0]
        sampling = {"max_tokens": 5, "temperature": 0, "ignore_eos": True, "logprobs": 3,
                    "prompt_logprobs": 2}
        status, raw = _post(f"{url}/generate", {"input_ids": ids, "sampling_params": sampling})
        assert status == 200, raw
        body = json.loads(raw)
        out = RequestOutput(0, None, ids, body["text"], body["token_ids"], "length",
                            logprobs=_entries(body["logprobs"]),
                            prompt_logprobs=[None, *_entries(body["prompt_logprobs"][1:])])
        assert body["prompt_logprobs"][0] is None
        check_sampled(tiny_chat_llama_dir, ids, out, 3)
        check_prompt(tiny_chat_llama_dir, ids, out, 2)

        status, raw = _post(f"{url}/generate", {"input_ids": ids, "stream": True,
                                                "sampling_params": sampling})
        assert status == 200, raw
        lines = [json.loads(line) for line in raw.decode().splitlines() if line]
        assert all(len(line["logprobs"]) == len(line["token_ids"]) for line in lines)
        assert [e for line in lines for e in _entries(line["logprobs"])] == out.logprobs
        assert [t for line in lines for t in line["token_ids"]] == out.token_ids
        assert lines[0]["prompt_logprobs"] == body["prompt_logprobs"]

        status, raw = _post(f"{url}/generate", {"input_ids": ids, "sampling_params": {
            "max_tokens": 0, "prompt_logprobs": 0}})
        assert status == 200, raw
        scored = json.loads(raw)
        assert scored["token_ids"] == [] and scored["finish_reason"] == "length"
        assert len(scored["prompt_logprobs"]) == len(ids)

        for bad, param in (({"logprobs": 21}, "logprobs"), ({"max_tokens": 0}, "max_tokens"),
                           ({"prompt_logprobs": -1}, "prompt_logprobs")):
            status, raw = _post(f"{url}/generate", {"input_ids": ids, "sampling_params": bad})
            assert status == 400, raw
            assert param in json.loads(raw)["error"]["param"], raw
    finally:
        proc.terminate()
        proc.wait(timeout=60)


async def test_the_engine_cores_fronts_get_the_in_process_logprobs(tiny_llama_dir: Path,
                                                                   tmp_path: Path) -> None:
    """Over ZeroMQ, whole and streamed, with requests asking for none beside: the same
    logprobs and prompt logprobs as in-process, a scoring request's included."""
    from tests.test_engine_core import Served

    batch = prompts(9, 12)
    params = [greedy(5, logprobs=2), greedy(5), greedy(5, prompt_logprobs=3, logprobs=0),
              SamplingParams(max_tokens=0, prompt_logprobs=1)] * 3
    options = {**OPTIONS, "max_extend_tokens": 16}
    async with AsyncEngine(str(tiny_llama_dir), skip_tokenizer_init=True, **options) as engine:
        expected = [await engine.generate(p, q) for p, q in zip(batch, params)]
    async with Served(AsyncEngine(str(tiny_llama_dir), skip_tokenizer_init=True, **options),
                      tmp_path, 1) as served:
        client = served.clients[0]
        whole = [await client.generate(p, q) for p, q in zip(batch, params)]
        streamed = []
        for p, q in zip(batch, params):
            streamed.append([d async for d in client.stream(p, q)])
    for want, got, deltas in zip(expected, whole, streamed):
        final = deltas[-1].output
        assert final is not None
        for out in (got, final):
            assert (out.token_ids, out.finish_reason) == (want.token_ids, want.finish_reason)
            same_entries(out.logprobs, want.logprobs)
            same_entries(out.prompt_logprobs, want.prompt_logprobs)
        if want.logprobs is not None:
            same_entries([e for d in deltas for e in d.logprobs or []], want.logprobs)
    assert expected[3].token_ids == [] and expected[3].prompt_logprobs is not None
    check_prompt(tiny_llama_dir, batch[3], expected[3], 1)
    check_sampled(tiny_llama_dir, batch[0], expected[0], 2)
