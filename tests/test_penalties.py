"""Penalties, logit_bias, min_tokens and stop_token_ids: greedy outputs equal transformers'
logits with the penalty formulas applied here (transformers' own processor for
repetition_penalty); rows that ask for none keep their tokens whatever shares their batch;
the openai client against a real server; the 400s."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncinfer.api import LLM
from asyncinfer.core import Batch
from asyncinfer.engine.sampler import Sampler
from asyncinfer.errors import InvalidRequestError
from asyncinfer.params import SamplingParams
from asyncinfer.tokenizer import Tokenizer
from tests.hf_reference import hf_last_logits, load_hf
from tests.test_llm import tiny_llm
from tests.test_server_process import NAME

TINY_EOS = 1  # tiny_llama_dir's eos_token_id


def reference(hf: torch.nn.Module, prompt: list[int], params: SamplingParams,
              eos: frozenset[int] = frozenset({TINY_EOS})) -> list[int]:
    """Greedy tokens under ``params`` from transformers' logits: bias added, the ids
    min_tokens holds back masked, then repetition (transformers' processor) and the OpenAI
    presence and frequency penalties over the output, as vLLM orders them."""
    from transformers import RepetitionPenaltyLogitsProcessor

    out: list[int] = []
    stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos))
    for _ in range(params.max_tokens):
        logits = hf_last_logits(hf, prompt + out).clone()
        for token, bias in params.logit_bias:
            logits[token] += bias
        if len(out) < params.min_tokens:
            logits[sorted(stops)] = float("-inf")
        if params.repetition_penalty != 1.0:
            processor = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)
            logits = processor(torch.tensor([prompt + out]), logits[None])[0]
        for token, count in Counter(out).items():
            logits[token] -= params.frequency_penalty * count + params.presence_penalty
        token = int(logits.argmax())
        out.append(token)
        if token in stops and len(out) > params.min_tokens:
            break
    return out


def _prompts() -> list[list[int]]:
    import random

    rng = random.Random(3)
    # Short alphabets make the random model repeat, so the penalties have work to do.
    return [[rng.choice([7, 11, 13, 42]) for _ in range(rng.randrange(3, 30))]
            for _ in range(3)] + [[rng.randrange(3, 500) for _ in range(45)]]


def _greedy(**fields: Any) -> SamplingParams:
    return SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, **fields)


PENALTIES = {
    "presence": _greedy(presence_penalty=1.5),
    "negative_presence": _greedy(presence_penalty=-1.0),
    "frequency": _greedy(frequency_penalty=0.8),
    "repetition": _greedy(repetition_penalty=1.4),
    "repetition_below_1": _greedy(repetition_penalty=0.6),
    "logit_bias": _greedy(logit_bias={5: 6.0, 9: -100.0, 17: 3.5, 42: -2.0}),
    "all": SamplingParams(max_tokens=12, temperature=0.0, presence_penalty=0.5,
                          frequency_penalty=0.5, repetition_penalty=1.2,
                          logit_bias={TINY_EOS: 4.0, 30: 2.0}, min_tokens=5,
                          stop_token_ids=[30]),
}


@pytest.fixture(scope="module")
def hf(tiny_llama_dir: Path) -> torch.nn.Module:
    return load_hf(tiny_llama_dir)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "whole"])
def test_penalized_greedy_equals_transformers_with_the_formulas(
        tiny_llama_dir: Path, hf: torch.nn.Module, overlap: bool, chunked: bool) -> None:
    """Every penalty beside plain rows in one batch, under chunked prefill and overlap."""
    prompts = _prompts()
    cases = [(p, params) for params in [_greedy(), *PENALTIES.values()] for p in prompts]
    expected = [reference(hf, p, params) for p, params in cases]
    plain = expected[: len(prompts)]
    for name, i in zip(PENALTIES, range(len(prompts), len(cases), len(prompts))):
        assert expected[i: i + len(prompts)] != plain, f"{name} changes no output here"
    llm = tiny_llm(tiny_llama_dir, max_running_requests=8, overlap=overlap,
                   chunked_prefill=chunked, max_extend_tokens=16 if chunked else 128,
                   cache_type="radix")
    outputs = llm.generate([p for p, _ in cases], [params for _, params in cases],
                           use_tqdm=False)
    llm.close()
    assert [o.token_ids for o in outputs] == expected


def test_min_tokens_holds_eos_and_stop_token_ids_back(tiny_llama_dir: Path) -> None:
    prompt = _prompts()[3]
    forced = {TINY_EOS: 100.0}
    llm = tiny_llm(tiny_llama_dir)
    eos_now, eos_held, eos_ignored, stop_now, stop_held, unheld = llm.generate(
        [prompt] * 6,
        [SamplingParams(max_tokens=10, temperature=0.0, logit_bias=forced),
         SamplingParams(max_tokens=10, temperature=0.0, logit_bias=forced, min_tokens=4),
         SamplingParams(max_tokens=3, temperature=0.0, logit_bias=forced, min_tokens=2,
                        ignore_eos=True),
         SamplingParams(max_tokens=10, temperature=0.0, logit_bias={30: 100.0},
                        stop_token_ids=[30]),
         SamplingParams(max_tokens=10, temperature=0.0, logit_bias={30: 100.0},
                        stop_token_ids=[30, 31], min_tokens=3),
         SamplingParams(max_tokens=4, temperature=0.0, logit_bias={30: 100.0},
                        min_tokens=3)],
        use_tqdm=False)
    llm.close()
    assert (eos_now.token_ids, eos_now.finish_reason) == ([TINY_EOS], "stop")
    assert eos_held.token_ids[4:] == [TINY_EOS] and eos_held.finish_reason == "stop"
    assert TINY_EOS not in eos_held.token_ids[:4]
    # ignore_eos: EOS is not held back, and does not stop.
    assert (eos_ignored.token_ids, eos_ignored.finish_reason) == ([TINY_EOS] * 3, "length")
    assert (stop_now.token_ids, stop_now.finish_reason) == ([30], "stop")
    assert stop_held.token_ids[3:] == [30] and stop_held.finish_reason == "stop"
    assert not {30, 31} & set(stop_held.token_ids[:3])
    # min_tokens holds back only what would stop the request.
    assert (unheld.token_ids, unheld.finish_reason) == ([30] * 4, "length")


def _seeded(seed: int, **fields: Any) -> SamplingParams:
    return SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, seed=seed,
                          ignore_eos=True, **fields)


def test_penalized_rows_change_no_other_rows_tokens(tiny_llama_dir: Path) -> None:
    """Plain greedy and seeded rows, and a seeded penalized one, give their solo tokens
    beside penalized and biased rows."""
    prompts = _prompts()
    own = [(prompts[0], _greedy()), (prompts[1], _seeded(11)), (prompts[3], _greedy()),
           (prompts[2], _seeded(12, presence_penalty=1.0, logit_bias={7: -3.0}))]
    others = [(prompts[1], _greedy(frequency_penalty=1.0, logit_bias={11: 50.0})),
              (prompts[0], _seeded(5, repetition_penalty=1.5)),
              (prompts[3], _greedy(presence_penalty=2.0, min_tokens=3)),
              (prompts[2], SamplingParams(max_tokens=10, temperature=0.7,
                                          logit_bias={13: 5.0}, stop_token_ids=[9]))]
    llm = tiny_llm(tiny_llama_dir, max_running_requests=8)
    solo = [llm.generate([p], [params], use_tqdm=False)[0].token_ids for p, params in own]
    mixed = [(p, params) for pair in zip(own, others) for p, params in pair]
    together = llm.generate([p for p, _ in mixed], [params for _, params in mixed],
                            use_tqdm=False)
    llm.close()
    assert [o.token_ids for o in together[0::2]] == solo


def test_adjust_leaves_raw_logits_and_plain_rows_bit_identical() -> None:
    """The sampler's adjusted logits: plain rows are the raw ones, bit for bit, the raw
    tensor is never written, and a penalized row is the formula over its token-pool row."""
    torch.manual_seed(0)
    vocab, width = 40, 16
    pool = torch.randint(0, vocab, (5, width))
    logits = torch.randn(4, vocab) * 3
    raw = logits.clone()
    params = [SamplingParams(), SamplingParams(presence_penalty=0.7, frequency_penalty=0.3,
                                               repetition_penalty=1.3),
              SamplingParams(), SamplingParams(logit_bias={3: 2.0, 39: -5.0})]
    batch = Batch(rows=[2, 0, 4, 1], starts=[5, 9, 2, 3], ends=[6, 10, 3, 4], params=params,
                  steps=[1, 4, 1, 1], prompt_lens=[5, 6, 2, 3])
    adjusted = Sampler().adjust(logits, batch, pool)
    assert torch.equal(logits, raw)
    assert torch.equal(adjusted[[0, 2]], raw[[0, 2]])
    seq = pool[0, :10].tolist()
    row = raw[1].clone()
    for token in set(seq):
        row[token] = row[token] / 1.3 if row[token] > 0 else row[token] * 1.3
    for token, count in Counter(seq[6:]).items():
        row[token] -= 0.3 * count + 0.7
    assert torch.allclose(adjusted[1], row, atol=1e-6)
    biased = raw[3].clone()
    biased[3] += 2.0
    biased[39] -= 5.0
    assert torch.equal(adjusted[3], biased)
    assert Sampler().adjust(logits, Batch(rows=[0], starts=[0], ends=[3],
                                          params=[SamplingParams()], steps=[0]), pool) is logits


@pytest.mark.parametrize("fields, param", [
    ({"logit_bias": {512: 1.0}}, "logit_bias"),
    ({"stop_token_ids": [3, 600]}, "stop_token_ids"),
])
def test_token_ids_outside_the_vocabulary_are_refused(tiny_llama_dir: Path,
                                                      fields: dict[str, Any],
                                                      param: str) -> None:
    llm = tiny_llm(tiny_llama_dir)
    with pytest.raises(InvalidRequestError, match="outside the vocabulary") as caught:
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, **fields), use_tqdm=False)
    [out] = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)
    llm.close()
    assert caught.value.param == param
    assert len(out.token_ids) == 2


def test_two_ranks_give_one_ranks_penalized_tokens(tiny_llama_dir: Path,
                                                   hf: torch.nn.Module) -> None:
    """Every rank adjusts its own copy of the logits from its own token pool: the ranks
    agree on every batch (checked each round) and give the reference's tokens."""
    prompts = _prompts()
    cases = [(p, params) for params in PENALTIES.values() for p in prompts[::2]]
    llm = LLM(str(tiny_llama_dir), skip_tokenizer_init=True, tensor_parallel_size=2,
              dtype="float32", page_size=4, max_running_requests=8, num_pages=256,
              max_seq_len=128, tp_guard_interval=1)
    outputs = llm.generate([p for p, _ in cases], [params for _, params in cases],
                           use_tqdm=False)
    llm.close()
    assert [o.token_ids for o in outputs] == [reference(hf, p, params) for p, params in cases]


async def test_the_engine_core_refuses_ids_outside_the_vocabulary_as_an_event(
        tiny_llama_dir: Path, tmp_path: Path) -> None:
    """Past the front (whose tokenizer may know fewer ids), the core answers "invalid"."""
    from tests.test_async_engine import tiny_engine
    from tests.test_engine_core import Served

    async with Served(tiny_engine(tiny_llama_dir), tmp_path, 1) as served:
        client = served.clients[0]
        bad = await client.generate([5, 6, 7], SamplingParams(max_tokens=2,
                                                              stop_token_ids=[512]))
        good = await client.generate([5, 6, 7], SamplingParams(max_tokens=2))
    assert (bad.finish_reason, bad.error_kind) == ("error", "invalid")
    assert bad.error is not None and "stop_token_ids" in bad.error
    assert (good.finish_reason, len(good.token_ids)) == ("length", 2)


# The embedded SmolLM2 through a real server and the openai client.

REPEATS = "List the colors: red, blue, red, blue, red,"


@pytest.fixture(scope="module")
def server(plain_server: str) -> str:
    return plain_server


@pytest.fixture(scope="module")
def client(server: str) -> Any:
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused")


@pytest.fixture(scope="module")
def tokenizer(served_model: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(served_model)


def test_openai_logit_bias_forces_a_token(client: Any, tokenizer: Tokenizer) -> None:
    [token] = tokenizer.encode(" banana")
    whole = client.completions.create(model=NAME, prompt="My favourite fruit is", max_tokens=4,
                                      temperature=0.0, logit_bias={str(token): 100})
    assert whole.choices[0].text == " banana" * 4
    chat = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "Name a fruit."}], max_tokens=3,
        temperature=0.0, logit_bias={str(token): 100}, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chat if c.choices) == (
        " banana" * 3)


def test_openai_presence_penalty_changes_a_repetitive_output(client: Any) -> None:
    def words(**extra: Any) -> list[str]:
        text = client.completions.create(model=NAME, prompt=REPEATS, max_tokens=24, temperature=0.0,
                                         **extra).choices[0].text
        return text.replace(",", " ").split()

    plain, penalized = words(), words(presence_penalty=2.0, frequency_penalty=1.0)
    assert len(set(plain)) <= 3 and len(plain) >= 6, plain  # the model repeats here
    assert penalized != plain
    assert len(set(penalized)) > len(set(plain))


def test_openai_min_tokens_holds_eos_back(client: Any) -> None:
    eos = {"2": 100}  # <|im_end|>, the embedded model's EOS
    now = client.completions.create(model=NAME, prompt="Hello", max_tokens=8, temperature=0.0,
                                    logit_bias=eos)
    held = client.completions.create(model=NAME, prompt="Hello", max_tokens=8, temperature=0.0,
                                     logit_bias=eos, extra_body={"min_tokens": 5})
    assert (now.usage.completion_tokens, now.choices[0].finish_reason) == (1, "stop")
    assert (held.usage.completion_tokens, held.choices[0].finish_reason) == (6, "stop")
    assert held.choices[0].text and now.choices[0].text == ""


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_openai_stop_token_ids_stop_without_their_text(client: Any, server: str,
                                                       tokenizer: Tokenizer,
                                                       stream: bool) -> None:
    prompt = tokenizer.encode("The capital of France is")
    status, plain = _post(server, "/generate", {"input_ids": prompt, "sampling_params": {
        "max_tokens": 8, "temperature": 0.0}})
    assert status == 200
    ids = plain["token_ids"]
    stop = next(t for i, t in enumerate(ids) if i >= 2 and t not in ids[:i])
    at = ids.index(stop)
    request = {"prompt": prompt, "max_tokens": 8, "temperature": 0.0,
               "extra_body": {"stop_token_ids": [stop]}}
    if stream:
        chunks = list(client.completions.create(model=NAME, stream=True, **request))
        got = "".join(c.choices[0].text for c in chunks if c.choices)
        reason = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    else:
        whole = client.completions.create(model=NAME, **request)
        got, reason = whole.choices[0].text, whole.choices[0].finish_reason
        assert whole.usage.completion_tokens == at + 1
    assert (got, reason) == (tokenizer.decode(ids[:at]), "stop")
    assert got != plain["text"]


def _post(server: str, route: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(f"{server}{route}", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_generate_takes_the_vllm_extensions(server: str) -> None:
    base = {"input_ids": [1, 504, 3458, 282], "sampling_params": {
        "max_tokens": 6, "temperature": 0.0, "logit_bias": {"2": 100.0}}}
    status, now = _post(server, "/generate", base)
    assert status == 200 and (now["token_ids"], now["finish_reason"]) == ([2], "stop"), now
    held = {**base["sampling_params"], "min_tokens": 3, "repetition_penalty": 1.3,
            "stop_token_ids": [2]}
    status, out = _post(server, "/generate", {**base, "sampling_params": held})
    assert status == 200 and out["token_ids"][3:] == [2], out
    assert out["finish_reason"] == "stop" and 2 not in out["token_ids"][:3]


BAD = [
    ({"logit_bias": {"42": 101}}, "logit_bias"),
    ({"logit_bias": {"49152": 1}}, "logit_bias"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -2.01}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"stop_token_ids": [49152]}, "stop_token_ids"),
    ({"stop_token_ids": ["2"]}, "stop_token_ids"),
]


@pytest.mark.parametrize("fields, param", BAD, ids=[f"{p}-{i}" for i, (_, p) in
                                                     enumerate(BAD)])
def test_bad_values_are_400s_naming_the_field(client: Any, server: str,
                                              fields: dict[str, Any], param: str) -> None:
    openai = pytest.importorskip("openai")
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=NAME, prompt="Hi", extra_body=fields)
    assert caught.value.body["param"] == param, caught.value.body
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}],
                                       extra_body=fields)
    assert caught.value.body["param"] == param, caught.value.body
    status, body = _post(server, "/generate", {"prompt": "Hi", "sampling_params": fields})
    assert status == 400 and body["error"]["param"] == f"sampling_params.{param}", body
