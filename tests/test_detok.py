"""Incremental detokenisation (`metaloom.decode.detok`): the streamed text equals the full decode
exactly (real SmolLM2 byte-level BPE, toy tokenizers), at O(new tokens) per step; the
documented exceptions are pinned here too."""

import random
from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metaloom.decode.detok import CONTEXT_TOKENS, CUT_AFTER, MAX_HELD, IncrementalDetokenizer
from metaloom.testing.table_models import WordTokenizer
from metaloom.testing.toy_models import CharTokenizer

FFFD = "\ufffd"

PROSE = ("The quick brown fox jumps over the lazy dog. It wasn't the first time; in fact, "
         "the dog had seen it 3 times already (twice on Tuesday).")
CODE = ('def f(x):\n    if x > 0:\n        return [i ** 2 for i in range(x)]\n'
        '    else:\n\t\treturn {"a": None}\n\n\nclass A:\n    pass\n')
MULTIBYTE = "🦜🔥 你好世界 — naïve café, Ünïcödé ß ∑ 𝔘 한국어 العربية 👩‍👩‍👧 "
SPACES = "a  b   c    d\n\n\n  \n\t\t x \r\n     \n"
TEXTS = [PROSE, CODE, MULTIBYTE, SPACES, PROSE + MULTIBYTE + CODE]


class CountingTokenizer:
    """Wraps a tokenizer, counting the token ids that `decode` is given."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.ids = 0
        self.longest = 0

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.inner.eos_token_ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.inner.encode(text, add_special_tokens)

    def decode(self, ids: Sequence[int]) -> str:
        self.ids += len(ids)
        self.longest = max(self.longest, len(ids))
        return self.inner.decode(ids)

    def apply_chat_template(self, messages, *, add_generation_prompt: bool = True) -> str:
        return self.inner.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)


def stream(tokenizer, ids: Sequence[int], context: Sequence[int] = ()) -> str:
    """Push ``ids`` one by one; the concatenated pushes plus flush, checked against `text`."""
    detok = IncrementalDetokenizer(tokenizer, context)
    pieces = [detok.push(t) for t in ids]
    pieces.append(detok.flush())
    assert detok.text == "".join(pieces)
    return "".join(pieces)


def expected(tokenizer, ids: Sequence[int], context: Sequence[int] = ()) -> str:
    """The guarantee of the module docstring: the full decode minus the context's final text."""
    full = tokenizer.decode([*context, *ids])
    return full[len(tokenizer.decode(list(context)).removesuffix(FFFD)):]


@pytest.fixture(scope="module")
def tok(smollm):
    return smollm.tokenizer


@pytest.fixture(scope="module")
def byte_tokens(tok):
    """Tokens that decode alone to "\\ufffd": bytes of a character split over several tokens."""
    found = [i for i in range(tok.vocab_size) if tok.decode([i]) == FFFD]
    assert len(found) > 100
    return found


@pytest.fixture(scope="module")
def specials(tok):
    ids = [tok.token_to_id(s) for s in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")]
    assert None not in ids and all(tok.decode([i]) == "" for i in ids)
    return ids


# --- exact equality on the real tokenizer ----------------------------------------------------

@pytest.mark.parametrize("text", TEXTS, ids=["prose", "code", "multibyte", "spaces", "mixed"])
def test_streamed_text_equals_full_decode(tok, text):
    ids = tok.encode(text)
    assert tok.decode(ids) == text  # byte-level BPE round-trips
    assert stream(tok, ids) == text


def test_characters_split_over_tokens_are_held_back_until_complete(tok):
    text = "🦜🔥你好世界"
    ids = tok.encode(text)
    split = [i for i in ids if tok.decode([i]) == FFFD]
    assert len(split) >= len(ids) // 2  # the case is covered: most tokens are partial characters
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.push(i) for i in ids]
    assert all(FFFD not in p for p in pieces)  # never a partial character in the stream
    assert "" in pieces  # some pushes held their bytes back
    assert [p for p in pieces if p] == list(text)  # each character appears once it is complete
    assert detok.flush() == "" and detok.text == text


def test_context_makes_the_first_tokens_decode_as_after_it(tok):
    context = tok.encode("Hello")
    ids = tok.encode(" world")
    assert stream(tok, ids, context) == " world" == tok.decode(context + ids)[len("Hello"):]
    # a long context: only its end is decoded, and the text excludes it
    long_context = tok.encode(PROSE * 20)
    counting = CountingTokenizer(tok)
    assert stream(counting, ids, long_context) == " world"
    assert counting.longest < 3 * CONTEXT_TOKENS
    # a chat prompt (ending in special tokens and a newline) and an answer ending in <|im_end|>
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Hi"}]))
    answer = [*tok.encode("Sure! 🦜 你好"), tok.token_to_id("<|im_end|>")]
    assert stream(tok, answer, prompt) == expected(tok, answer, prompt) == "Sure! 🦜 你好"


def test_random_token_sequences_match_the_full_decode(tok, byte_tokens, specials):
    """Hundreds of random sequences (with and without context), some made mostly of byte tokens
    (invalid UTF-8, incomplete characters) and special tokens."""
    rng = random.Random(1234)

    def draw(p_byte: float, p_special: float) -> int:
        r = rng.random()
        if r < p_byte:
            return rng.choice(byte_tokens)
        return rng.choice(specials) if r < p_byte + p_special else rng.randrange(tok.vocab_size)

    for k in range(400):
        p_byte, p_special = [(0.0, 0.0), (0.1, 0.02), (0.7, 0.0), (0.5, 0.3)][k % 4]
        ids = [draw(p_byte, p_special) for _ in range(rng.randrange(10, 50))]
        context = [draw(p_byte, p_special) for _ in range(rng.randrange(0, 12) if k % 3 else 0)]
        assert stream(tok, ids, context) == expected(tok, ids, context), (ids, context)


_ALPHABET = st.one_of(st.characters(codec="utf-8"), st.sampled_from(list("aé你🦜 \n\t👩‍")))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(_ALPHABET, max_size=60), cut=st.integers(0, 80))
def test_property_encode_then_stream_token_by_token(tok, text, cut):
    ids = tok.encode(text)
    assert stream(tok, ids) == tok.decode(ids)
    context, rest = ids[:cut], ids[cut:]  # any split of it, the first part as context
    assert stream(tok, rest, context) == expected(tok, rest, context)


def test_special_tokens_do_not_break_the_window(tok, specials):
    im_end = specials[2]
    # special tokens between the bytes of one character: decode skips them, so must we
    ni = tok.encode("你")
    assert len(ni) == 2 and tok.decode(ni[:1]) == FFFD
    for n in (1, CUT_AFTER + 1, MAX_HELD + 1, 3 * MAX_HELD):
        ids = [*tok.encode("a"), ni[0], *[im_end] * n, ni[1], *tok.encode("b")]
        counting = CountingTokenizer(tok)
        assert stream(counting, ids) == "a你b" == tok.decode(ids)
        assert counting.longest <= MAX_HELD + 2 * CONTEXT_TOKENS
    # special tokens anywhere, and a context that ends in many of them after a split character
    ids = [im_end, *tok.encode("x "), im_end, im_end, *tok.encode("y"), im_end]
    assert stream(tok, ids) == tok.decode(ids) == "x y"
    context = [*tok.encode("Hi "), ni[0], *[im_end] * (2 * CONTEXT_TOKENS)]
    assert tok.decode(context) == "Hi " + FFFD
    assert stream(tok, [ni[1]], context) == "你"


# --- cost ------------------------------------------------------------------------------------

def test_cost_is_linear_in_the_number_of_tokens(tok):
    ids = tok.encode((PROSE + CODE + MULTIBYTE + SPACES) * 20)[:2000]
    assert len(ids) == 2000
    counting = CountingTokenizer(tok)
    assert stream(counting, ids) == tok.decode(ids)
    naive = len(ids) * (len(ids) + 1) // 2  # re-decoding the whole output on every step
    assert counting.ids <= 8 * len(ids), counting.ids
    assert counting.ids * 100 < naive
    assert counting.longest <= 2 * CONTEXT_TOKENS  # every decode is a short window


def test_cost_stays_bounded_on_degenerate_streams(tok, byte_tokens, specials):
    """Invalid UTF-8 that never completes and runs of special tokens: the window stays short."""
    rng = random.Random(7)
    streams = {
        "stray bytes": [rng.choice(byte_tokens) for _ in range(2000)],
        "continuation bytes": [tok.encode("你")[1]] * 2000,
        "a character after stray bytes": [*[tok.encode("你")[1]] * MAX_HELD, *tok.encode("你")] * 100,
        "specials": [specials[0]] * 2000,
        "text then specials": [*tok.encode("Hi"), *[specials[2]] * 2000, *tok.encode(" there")],
    }
    for name, ids in streams.items():
        counting = CountingTokenizer(tok)
        assert stream(counting, ids) == tok.decode(ids), name
        assert counting.ids <= 16 * len(ids), (name, counting.ids)
        assert counting.longest <= MAX_HELD + 2 * CONTEXT_TOKENS, (name, counting.longest)


# --- fork --------------------------------------------------------------------------------------

def test_fork_is_an_independent_copy(tok):
    parent = IncrementalDetokenizer(tok)
    for i in tok.encode("Hello"):
        parent.push(i)
    child = parent.fork()
    for i in tok.encode(" world"):
        parent.push(i)
    for i in tok.encode(" there"):
        child.push(i)
    assert parent.text == "Hello world" and child.text == "Hello there"
    # forked in the middle of a character: 🦜 and 🔥 share their first token
    parrot, fire = tok.encode("🦜"), tok.encode("🔥")
    assert parrot[0] == fire[0] and tok.decode(parrot[:1]) == FFFD
    parent = IncrementalDetokenizer(tok, tok.encode("Hi"))
    assert parent.push(tok.encode(" ")[0]) == " " and parent.push(parrot[0]) == ""
    child = parent.fork()
    assert "".join(parent.push(i) for i in parrot[1:]) == "🦜"
    assert "".join(child.push(i) for i in fire[1:]) == "🔥"
    assert (parent.flush(), child.flush()) == ("", "")
    assert (parent.text, child.text) == (" 🦜", " 🔥")


def test_forks_at_random_points_match_their_full_decodes(tok, byte_tokens):
    rng = random.Random(5)
    for _ in range(50):
        ids = [rng.choice(byte_tokens) if rng.random() < 0.4 else rng.randrange(tok.vocab_size) for _ in range(30)]
        alt = [rng.choice(byte_tokens) if rng.random() < 0.4 else rng.randrange(tok.vocab_size) for _ in range(10)]
        k = rng.randrange(len(ids))
        detok = IncrementalDetokenizer(tok)
        for i in ids[:k]:
            detok.push(i)
        fork = detok.fork()
        for i in ids[k:]:
            detok.push(i)
        for i in alt:
            fork.push(i)
        assert detok.text + detok.flush() == tok.decode(ids)
        assert fork.text + fork.flush() == tok.decode(ids[:k] + alt)


# --- toy tokenizers ----------------------------------------------------------------------------

def test_char_tokenizer():
    tokenizer = CharTokenizer(26, eos=25)
    rng = random.Random(3)
    for _ in range(100):
        ids = [rng.randrange(26) for _ in range(rng.randrange(0, 30))]
        context = [rng.randrange(26) for _ in range(rng.randrange(0, 5))]
        assert stream(tokenizer, ids, context) == tokenizer.decode(context + ids)[len(tokenizer.decode(context)):]


def test_word_tokenizer_keeps_the_spaces_between_words():
    """`WordTokenizer.decode` joins words with spaces (not concatenative) and skips <eos>: the
    space before a word depends on the words before it, even across runs of <eos>."""
    tokenizer = WordTokenizer(["the", "cat", "sat", "<eos>"])
    assert stream(tokenizer, [0, 1, 2]) == "the cat sat"
    assert stream(tokenizer, [1, 2], [0]) == " cat sat"
    assert stream(tokenizer, [0, *[3] * 20, 1]) == "the cat"
    assert stream(tokenizer, [*[3] * 20, 0, 1]) == "the cat"
    rng = random.Random(4)
    for _ in range(200):
        ids = [rng.randrange(4) for _ in range(rng.randrange(0, 20))]
        context = [rng.randrange(4) for _ in range(rng.randrange(0, 10))]
        assert stream(tokenizer, ids, context) == expected(tokenizer, ids, context), (ids, context)


# --- documented exceptions (module docstring) ---------------------------------------------------

def test_context_ending_inside_a_character_gives_that_character_to_the_output(tok):
    ids = tok.encode("Hi 🦜!")
    k = next(k for k in range(len(ids)) if tok.decode(ids[:k]).endswith(FFFD))
    context, rest = ids[:k], ids[k:]
    assert tok.decode(context) == "Hi " + FFFD
    assert tok.decode(rest).startswith(FFFD)  # without the context the bytes would not decode
    # not full[len(decode(context)):] == "!" but the completed character with it
    assert stream(tok, rest, context) == "🦜!" == tok.decode(ids)[len("Hi "):]


class CleanupTokenizer(CharTokenizer):
    """Token i is ALPHABET[i]; a decoder that is not prefix-stable: like transformers'
    ``clean_up_tokenization_spaces`` it deletes the space before ".", a space decoded already."""

    ALPHABET = "ab ."

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [self.ALPHABET.index(c) for c in text]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(self.ALPHABET[i] for i in ids).replace(" .", ".")


def test_decoder_that_is_not_prefix_stable_keeps_the_emitted_space():
    tokenizer = CleanupTokenizer(4)
    ids = tokenizer.encode("a .")
    assert tokenizer.decode(ids[:2]) == "a " and tokenizer.decode(ids) == "a."
    assert stream(tokenizer, ids) == "a ."  # the space was final when it was pushed
    assert stream(tokenizer, tokenizer.encode("ab. b")) == "ab. b"  # exact where nothing is deleted


class PendingTokenizer(CharTokenizer):
    """A decoder whose every non-empty text ends in "\\ufffd": no boundary is ever clean."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return super().decode(ids) + FFFD if ids else ""


def test_window_that_never_completes_is_given_up_after_max_held_tokens():
    tokenizer = CountingTokenizer(PendingTokenizer(26))
    ids = [i % 26 for i in range(100)]
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.push(i) for i in ids]
    assert "".join(pieces[:MAX_HELD]) == tokenizer.decode(ids[:MAX_HELD])[:-1]  # held: the last char
    assert pieces[MAX_HELD] == "q" + FFFD  # given up: emitted with its "\ufffd"
    part = MAX_HELD + 1  # ... and decoded afresh after it, as separate parts
    parts = [ids[i:i + part] for i in range(0, len(ids), part)]
    assert detok.text + detok.flush() == "".join(tokenizer.decode(p) for p in parts)
    assert tokenizer.longest <= part + 1


def test_push_after_a_flush_that_returned_text_starts_afresh(tok):
    ni = tok.encode("你")
    detok = IncrementalDetokenizer(tok)
    assert detok.push(ni[0]) == "" and detok.flush() == FFFD  # the end, as decode shows it
    assert detok.push(ni[1]) == "" and detok.flush() == FFFD  # a lone continuation byte
    assert detok.text == FFFD + FFFD == tok.decode(ni[:1]) + tok.decode(ni[1:])
    assert detok.flush() == ""  # nothing held: flush is idempotent


def test_module_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, metaloom.decode.detok; assert 'torch' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
