"""Incremental detokenizing (optimized/serving/text.py) on the tiny fixture's byte-level BPE tokenizer: the
streamed text equals the decode of the whole completion, tokens split mid-character included, and each token's
work is bounded whatever the completion's length."""

from __future__ import annotations

import functools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from optimized.serving import text as text_mod
from optimized.serving.text import Detokenizer, TextStream

pytest.importorskip("transformers")


@functools.lru_cache(maxsize=None)
def _tokenizer():
    from fixtures.checkpoints import checkpoint
    from optimized.model_loader.tokenizer import CheckpointTokenizer

    return CheckpointTokenizer.load(checkpoint("tiny"))


@functools.lru_cache(maxsize=None)
def _byte_tokens() -> dict[int, int]:
    """byte value -> the id of the token that is that single byte (the byte-level alphabet)."""
    hf = _tokenizer().hf
    # the byte-level alphabet: printable bytes stand for themselves, the others for 256 + their rank
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = {b: hf.convert_tokens_to_ids(chr(c)) for b, c in zip(bs, cs)}
    assert all(hf.decode([table[b]]) == chr(b) for b in range(128))
    return table


def streamed(ids, decode) -> tuple[str, Detokenizer, list[int]]:
    d, out, work = Detokenizer(decode), [], []
    for t in ids:
        before = d.decoded
        out.append(d.add(t))
        work.append(d.decoded - before)
    out.append(d.flush())
    return "".join(out), d, work


TEXTS = st.text(st.characters(codec="utf-8"), min_size=1, max_size=80)


@settings(max_examples=60, deadline=None)
@given(text=TEXTS)
def test_streamed_text_equals_full_decode_for_encoded_text(text):
    tok = _tokenizer()
    ids = tok.hf.encode(text)
    got, _, _ = streamed(ids, tok.decode)
    assert got == tok.decode(ids)


def test_multibyte_characters_are_split_mid_character_and_still_streamed_whole():
    tok = _tokenizer()
    text = "日本語 ünïcödé 🙂🙂 中中中"
    ids = tok.hf.encode(text)
    assert any("\ufffd" in tok.decode([t]) for t in ids), "the fixture must split some character over tokens"
    d = Detokenizer(tok.decode)
    pieces = [d.add(t) for t in ids] + [d.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)  # no half character is ever sent


@settings(max_examples=80, deadline=None)
@given(raw=st.lists(st.integers(0, 255), min_size=1, max_size=120))
def test_any_byte_sequence_streams_to_the_full_decode(raw):
    """Single-byte tokens, invalid and incomplete UTF-8 included (long runs of continuation bytes exercise the
    MAX_PENDING cut)."""
    tok = _tokenizer()
    table = _byte_tokens()
    ids = [table[b] for b in raw]
    got, _, _ = streamed(ids, tok.decode)
    assert got == tok.decode(ids)


def test_per_token_work_is_bounded_whatever_the_length():
    tok = _tokenizer()
    table = _byte_tokens()
    prose = tok.hf.encode("The capital of France is Paris. 日本語のテキスト。 " * 60)
    garbage = [table[0x80]] * 300 + [table[0xE4]] + [table[0xB8]] * 2  # never a valid character for 300 tokens
    for ids in (prose, garbage, prose + garbage + prose):
        got, d, work = streamed(ids, tok.decode)
        assert got == tok.decode(ids)
        bound = 2 * (text_mod.MAX_PENDING + 2) * (text_mod.MAX_PENDING + 4)
        assert max(work) <= bound, f"one token decoded {max(work)} ids (bound {bound}) over {len(ids)} tokens"
        assert d.decoded <= 8 * len(ids), f"{d.decoded} ids decoded for {len(ids)} tokens"


def test_decode_work_does_not_grow_with_the_completion():
    tok = _tokenizer()
    ids = tok.hf.encode("Hello! How are you today? " * 200)
    _, _, work = streamed(ids, tok.decode)
    n = len(work)
    assert max(work[n // 2 :]) <= max(work[: n // 10]) + 2  # the last tokens cost what the first ones did


def test_text_stream_hides_nothing_but_what_finish_releases():
    tok = _tokenizer()
    ids = tok.hf.encode("Paris 🙂")
    s = TextStream(tok, ["XYZ"])
    out = "".join(s.add(t, False) for t in ids[:-1])  # the last byte of the emoji is not added
    assert "\ufffd" not in out and s.offset == len(out)
    assert out + s.finish() == tok.decode(ids[:-1])  # the held half character comes out as U+FFFD at the end


def test_stop_strings_across_tokens_and_held_back_prefixes():
    class Chars:  # one character per id
        def decode(self, ids):
            return "".join(chr(i) for i in ids)

    t = TextStream(Chars(), ["XY"])
    assert [t.add(ord(c), False) for c in "abX"] == ["a", "b", ""] and not t.stopped
    assert t.offset == 3  # the held "X" is stable text: the next token starts at 3
    assert t.finish() == "X"  # the request ended (EOS): the held prefix is released


@settings(max_examples=60, deadline=None)
@given(
    words=st.lists(
        st.sampled_from(["Paris", " is", " 🙂", "\n", "<|im_start|>", "<|im_end|>", "<|endoftext|>"]), max_size=12
    ),
    skip=st.booleans(),
    spaces=st.booleans(),
)
def test_streamed_text_with_special_tokens_equals_its_whole_decode(words, skip, spaces):
    """Whatever the request's special-token options, the streamed text is the decode of the whole completion by the
    same rule: special tokens dropped, or kept (set apart by spaces or not)."""
    tok = _tokenizer()
    ids = [i for w in words for i in tok.hf.encode(w, add_special_tokens=False)]
    decode = text_mod.text_decoder(tok, skip, spaces)
    got, _, _ = streamed(ids, decode)
    assert got == decode(ids)
    specials = {"<|im_start|>", "<|im_end|>", "<|endoftext|>"}
    if skip:
        assert got == tok.hf.decode(ids, skip_special_tokens=True)  # HF's own rule
        assert not any(s in got for s in specials)
    else:
        assert [w for w in words if w in specials] == [w for w in got.split(" ") if w in specials] or not spaces
