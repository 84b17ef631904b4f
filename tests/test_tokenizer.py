"""The tokenizer wrapper and the incremental detokenizer, on the real SmolLM2 tokenizer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncinfer.errors import InvalidRequestError
from asyncinfer.params import SamplingParams
from asyncinfer.tokenizer import IncrementalDetokenizer, Tokenizer

IM_END = 2
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def tok(smollm2_dir: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(smollm2_dir)


def stream(det: IncrementalDetokenizer, ids: list[int], chunk: int = 1) -> list[str]:
    """Push ``ids`` ``chunk`` at a time, then finish; every delta, in order."""
    deltas = [det.push(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    return [*deltas, det.finish()]


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_deltas_concatenate_to_full_decode_and_never_split_a_character(
    tok: Tokenizer, data: st.DataObject
) -> None:
    # Pieces of encoded unicode text split multi-byte characters across tokens; random ids
    # bring byte-level tokens that are partial UTF-8 and special tokens.
    piece = st.one_of(
        st.integers(0, tok.vocab_size - 1).map(lambda i: [i]),
        st.text(max_size=12).map(tok.encode),
    )
    ids = data.draw(st.lists(piece, max_size=12).map(lambda ps: [i for p in ps for i in p]))
    skip_special = data.draw(st.booleans(), label="skip_special_tokens")
    prompt = tok.apply_chat_template(CHAT) if data.draw(st.booleans(), label="prompt") else []
    full = tok.decode(ids, skip_special_tokens=skip_special)

    det = tok.detokenizer(SamplingParams(skip_special_tokens=skip_special), prompt_ids=prompt)
    emitted = ""
    pos = 0
    while pos < len(ids):
        size = data.draw(st.integers(1, 5), label="chunk")
        emitted += det.push(ids[pos : pos + size])
        pos += size
        assert full.startswith(emitted)
        assert det.text == emitted
    emitted += det.finish()

    assert emitted == full
    assert det.text == full
    assert not det.stopped


@pytest.mark.parametrize("text", [
    "Hello, world!", "  two leading spaces", "naïve café déjà vu", "日本語のテキスト",
    "emoji 🎉🚀 and 👩‍👩‍👧 family", "tabs\tand\nnew lines\r\n", "Ελληνικά и кириллица",
])
def test_encode_then_decode_gives_the_text_back(tok: Tokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text)) == text


def test_chat_template_renders_chatml_ending_in_the_assistant_prompt(tok: Tokenizer) -> None:
    text = tok.decode(tok.apply_chat_template(CHAT), skip_special_tokens=False)
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("messages", [
    [], [{"role": "user"}], [{"content": "hi"}], [{"role": "user", "content": 3}], ["hi"],
])
def test_malformed_chat_messages_are_an_invalid_request(
    tok: Tokenizer, messages: list[dict[str, str]]
) -> None:
    with pytest.raises(InvalidRequestError):
        tok.apply_chat_template(messages)


def test_chat_without_a_template_is_an_invalid_request(smollm2_dir: Path) -> None:
    tok = Tokenizer.from_pretrained(smollm2_dir)
    tok.hf.chat_template = None
    with pytest.raises(InvalidRequestError, match="no chat template"):
        tok.apply_chat_template(CHAT)


def test_warm_builds_the_encoders_so_the_first_encode_builds_nothing(
    smollm2_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tokenizers

    built: list[str] = []
    from_str = tokenizers.Tokenizer.from_str
    monkeypatch.setattr(tokenizers.Tokenizer, "from_str",
                        lambda spec: built.append(spec) or from_str(spec))
    tok = Tokenizer.from_pretrained(smollm2_dir)
    assert tok.warm() is tok
    assert len(built) == 2, "both encoders, special tokens parsed and as text"
    ids = tok.encode("What is the capital of France?")
    tok.apply_chat_template(CHAT)
    assert len(built) == 2, "nothing more on the first requests"
    assert tok.decode(ids) == "What is the capital of France?"


def test_eos_ids_contain_im_end(tok: Tokenizer) -> None:
    assert tok.hf.convert_ids_to_tokens(IM_END) == "<|im_end|>"
    assert IM_END in tok.eos_token_ids


def test_eos_ids_include_a_generation_config_list(smollm2_dir: Path, tmp_path: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_dir / name, tmp_path / name)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert Tokenizer.from_pretrained(tmp_path).eos_token_ids == {2, 7}


def test_stop_string_cuts_the_text_before_it(tok: Tokenizer) -> None:
    det = tok.detokenizer(SamplingParams(stop="Paris"))
    ids = tok.encode("The capital of France is Paris. It is a big city.")
    deltas = stream(det, ids)
    assert "".join(deltas) == det.text == "The capital of France is "
    assert det.stopped
    assert det.stop_reason == "Paris"
    assert det.push(tok.encode(" more")) == "" and det.finish() == ""


def test_partial_stop_string_never_leaks_while_streaming(tok: Tokenizer) -> None:
    det = tok.detokenizer(SamplingParams(stop="Paris"))
    ids = tok.encode("Parallel paragraphs on Parisian Paris")
    final = "Parallel paragraphs on "
    for i in range(len(ids)):
        det.push(ids[i : i + 1])
        assert final.startswith(det.text)
    assert det.text == final
    assert det.stop_reason == "Paris"


def test_held_back_partial_stop_is_released_by_finish(tok: Tokenizer) -> None:
    det = tok.detokenizer(SamplingParams(stop="Paris"))
    streamed = "".join(det.push([i]) for i in tok.encode("We drove to Par"))
    assert not streamed.endswith("Par")
    assert streamed + det.finish() == "We drove to Par"
    assert not det.stopped


def test_stop_string_spanning_two_tokens_is_found(tok: Tokenizer) -> None:
    ids = tok.encode("hello world")
    assert [tok.decode([i]) for i in ids] == ["hello", " world"]
    det = tok.detokenizer(SamplingParams(stop="lo wo"))
    assert "".join(stream(det, ids)) == "hel"
    assert det.stopped


def test_earliest_of_several_stop_strings_wins(tok: Tokenizer) -> None:
    det = tok.detokenizer(SamplingParams(stop=["world", "ll"]))
    assert "".join(stream(det, tok.encode("hello world"), chunk=2)) == "he"
    assert det.stop_reason == "ll"


def test_every_token_piece_is_its_exact_bytes_and_its_text_where_they_decode(
        tok: Tokenizer) -> None:
    # The whole vocabulary: a piece's bytes concatenate to the text the tokens decode to;
    # a piece that is part of a character is spelled bytes:\xNN, as OpenAI's API does.
    partial = 0
    for token in range(tok.vocab_size):
        text, raw = tok.piece(token)
        try:
            decoded = raw.decode()
        except UnicodeDecodeError:
            partial += 1
            assert text == "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            continue
        assert text == decoded == tok.decode([token], skip_special_tokens=False)
    assert partial > 0, "a byte-level vocabulary has pieces of characters"
    ids = tok.encode("héllo 你好 world 🙂")
    assert b"".join(tok.piece(i)[1] for i in ids).decode() == "héllo 你好 world 🙂"
    assert [tok.piece(i)[0] for i in tok.encode("你")] == ["bytes:\\xe4\\xbd", "bytes:\\xa0"]


def test_special_ids_are_what_decode_skips(tok: Tokenizer) -> None:
    assert IM_END in tok.special_ids
    ids = [*tok.encode("hi"), IM_END, *tok.encode(" there")]
    kept = [i for i in ids if i not in tok.special_ids]
    assert tok.decode(ids, skip_special_tokens=True) == tok.decode(kept)
