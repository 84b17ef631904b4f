"""lm-evaluation-harness as a real client of `asyncinfer serve`: a multiple-choice task of
its own (a task YAML over a local JSONL, no hub) scored through ``local-completions`` (echo,
logprobs 1, max_tokens 1, the prompt's logprobs) agrees with lm-eval's own ``hf`` model on
the same weights, item by item; a generate_until task through ``local-chat-completions``
gives what ``hf`` gives under the same chat template. See docs/evaluation.md."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.test_server_process import NAME, served

pytest.importorskip("lm_eval")

TOLERANCE = 1e-3    # float32 on both sides; a loglikelihood sums a few tokens' logprobs

# 30 questions with one right answer among four.
MULTIPLE_CHOICE = [
    ("The capital of France is", ["Paris", "Berlin", "Madrid", "Rome"], 0),
    ("The capital of Germany is", ["Vienna", "Berlin", "Warsaw", "Prague"], 1),
    ("The capital of Italy is", ["Milan", "Naples", "Rome", "Turin"], 2),
    ("The capital of Spain is", ["Lisbon", "Barcelona", "Seville", "Madrid"], 3),
    ("The capital of Japan is", ["Tokyo", "Osaka", "Kyoto", "Seoul"], 0),
    ("The largest planet in the solar system is", ["Mars", "Jupiter", "Venus", "Mercury"], 1),
    ("Water freezes at a temperature of", ["50 degrees", "10 degrees", "0 degrees",
                                           "90 degrees"], 2),
    ("The opposite of hot is", ["warm", "big", "fast", "cold"], 3),
    ("A baby cat is called a", ["kitten", "puppy", "calf", "foal"], 0),
    ("The colour of the clear daytime sky is", ["green", "blue", "red", "brown"], 1),
    ("Two plus two equals", ["five", "three", "four", "six"], 2),
    ("The day after Monday is", ["Sunday", "Friday", "Thursday", "Tuesday"], 3),
    ("Bees make", ["honey", "milk", "silk", "wool"], 0),
    ("The Earth revolves around the", ["Moon", "Sun", "Mars", "comet"], 1),
    ("The chemical symbol for water is", ["CO2", "O2", "H2O", "NaCl"], 2),
    ("A triangle has this many sides:", ["five", "six", "four", "three"], 3),
    ("The author of Romeo and Juliet is William", ["Shakespeare", "Wordsworth", "Blake",
                                                   "Golding"], 0),
    ("The fastest land animal is the", ["tortoise", "cheetah", "cow", "snail"], 1),
    ("Ice is the solid form of", ["air", "salt", "water", "sand"], 2),
    ("The month after January is", ["March", "December", "April", "February"], 3),
    ("The longest river in Africa is the", ["Nile", "Thames", "Seine", "Danube"], 0),
    ("Plants take in carbon dioxide and give off", ["helium", "oxygen", "neon", "argon"], 1),
    ("The number of days in a week is", ["five", "ten", "seven", "nine"], 2),
    ("The first letter of the English alphabet is", ["Z", "M", "Q", "A"], 3),
    ("The capital of the United Kingdom is", ["London", "Dublin", "Paris", "Oslo"], 0),
    ("A spider has this many legs:", ["six", "eight", "four", "ten"], 1),
    ("The Statue of Liberty stands in the city of", ["Chicago", "Boston", "New York",
                                                     "Miami"], 2),
    ("The tallest mountain on Earth is Mount", ["Fuji", "Kilimanjaro", "Etna", "Everest"], 3),
    ("Python is a programming", ["language", "banana", "river", "mountain"], 0),
    ("The capital of Canada is", ["Toronto", "Ottawa", "Vancouver", "Montreal"], 1),
]
GENERATE = [
    "What is the capital of France? Answer in one word.",
    "What is 2 + 3? Answer with a number.",
    "Name a colour of the rainbow.",
    "What animal says meow?",
    "What is the opposite of up?",
    "Which planet do we live on?",
]
MAX_GEN_TOKS = 12


def write_tasks(root: Path) -> Path:
    """The two tasks' YAML and JSONL files under ``root`` (lm-eval's ``include_path``)."""
    root.mkdir()
    mc = root / "capitals.jsonl"
    mc.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n"
                          for q, c, a in MULTIPLE_CHOICE))
    gen = root / "short_answers.jsonl"
    gen.write_text("".join(json.dumps({"question": q, "answer": ""}) + "\n"
                           for q in GENERATE))
    (root / "asyncinfer_mc.yaml").write_text(f"""\
task: asyncinfer_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {mc}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
""")
    (root / "asyncinfer_gen.yaml").write_text(f"""\
task: asyncinfer_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {gen}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: answer
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: {MAX_GEN_TOKS}
  do_sample: false
  temperature: 0.0
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
""")
    return root


@pytest.fixture(scope="module")
def tasks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tasks(tmp_path_factory.mktemp("lm_eval") / "tasks")


@pytest.fixture(scope="module")
def server(served_model: Path) -> Iterator[str]:
    with served(served_model) as url:
        yield url


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No hub: the datasets are local files, the models local directories."""
    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))


def evaluate(tasks: Path, task: str, model: str, model_args: dict[str, Any],
             **options: Any) -> dict[str, Any]:
    """lm-eval's ``simple_evaluate`` of one task, its per-item samples logged."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    results = lm_eval.simple_evaluate(
        model=model, model_args=model_args, tasks=[task], batch_size=1, log_samples=True,
        task_manager=TaskManager(include_path=str(tasks)), random_seed=0, numpy_random_seed=0,
        torch_random_seed=0, fewshot_random_seed=0, **options)
    assert results is not None
    return results


def hf_args(model: Path) -> dict[str, Any]:
    return {"pretrained": str(model), "dtype": "float32", "device": "cpu"}


def loglikelihoods(results: dict[str, Any], task: str) -> dict[int, list[float]]:
    """Each item's loglikelihood of each choice."""
    return {s["doc_id"]: [r[0][0] for r in s["resps"]] for s in results["samples"][task]}


def test_multiple_choice_through_local_completions_equals_hf(
        server: str, served_model: Path, tasks: Path) -> None:
    api = evaluate(tasks, "asyncinfer_mc", "local-completions", {
        "base_url": f"{server}/v1/completions", "model": NAME,
        "tokenizer_backend": "huggingface", "tokenizer": str(served_model),
        "tokenized_requests": True, "num_concurrent": 4, "max_retries": 1})
    hf = evaluate(tasks, "asyncinfer_mc", "hf", hf_args(served_model))

    served, reference = loglikelihoods(api, "asyncinfer_mc"), loglikelihoods(hf, "asyncinfer_mc")
    assert sorted(served) == sorted(reference) == list(range(len(MULTIPLE_CHOICE)))
    worst = max(abs(a - b) for i in served for a, b in zip(served[i], reference[i], strict=True))
    assert worst <= TOLERANCE
    # Every item is decided the same way, so the accuracies are equal.
    for i in served:
        assert served[i].index(max(served[i])) == reference[i].index(max(reference[i]))
    accuracy = api["results"]["asyncinfer_mc"]["acc,none"]
    assert accuracy == hf["results"]["asyncinfer_mc"]["acc,none"]
    assert accuracy > 0.5, "the embedded model knows most of these"
    print(f"\nasyncinfer_mc: accuracy {accuracy:.4f} through local-completions and hf; "
          f"largest loglikelihood difference {worst:.2e} over {len(MULTIPLE_CHOICE) * 4} "
          f"choices")


def test_generate_until_through_local_chat_completions_equals_hf(
        server: str, served_model: Path, tasks: Path) -> None:
    api = evaluate(tasks, "asyncinfer_gen", "local-chat-completions", {
        "base_url": f"{server}/v1/chat/completions", "model": NAME, "num_concurrent": 1,
        "max_retries": 1}, apply_chat_template=True)
    hf = evaluate(tasks, "asyncinfer_gen", "hf", hf_args(served_model),
                  apply_chat_template=True)

    def responses(results: dict[str, Any]) -> dict[int, str]:
        return {s["doc_id"]: s["resps"][0][0] for s in results["samples"]["asyncinfer_gen"]}

    served, reference = responses(api), responses(hf)
    assert sorted(served) == list(range(len(GENERATE)))
    assert all(served.values()), "every question has an answer"
    assert served == reference
    print(f"\nasyncinfer_gen: {len(served)} answers through local-chat-completions equal hf's: "
          + "; ".join(f"{GENERATE[i]!r} -> {served[i]!r}" for i in sorted(served)))
