"""Token healing with the real SmolLM2 tokenizer: the prompt backs up over its last token and
the output extends the removed text; it composes with grammars."""

import re

import pytest
import torch

from metaloom.constrain import ConstraintSpec
from metaloom.decode.healing import HealingCursor, heal_prompt
from metaloom.errors import InvalidParameter
from metaloom.generator import Request
from metaloom.ledger import Ledger
from metaloom.sampling import SamplingParams

URL_PROMPT = "The url is http:"


@pytest.fixture(scope="module")
def vocab(smollm_generator):
    return smollm_generator.vocabulary


def test_heal_prompt_removes_the_last_token(smollm, vocab):
    ids = smollm.tokenizer.encode(URL_PROMPT)
    healed = heal_prompt(ids, vocab)
    assert healed.removed == ":" and list(healed.ids) == ids[:-1]


def test_heal_prompt_backs_up_to_a_character_boundary_and_never_over_special_tokens(smollm, vocab):
    tok = smollm.tokenizer
    ids = tok.encode("The bird 🦩")  # the emoji is split over byte tokens
    healed = heal_prompt(ids, vocab)
    assert healed.removed == " 🦩" and tok.decode(list(healed.ids)) + healed.removed == "The bird 🦩"
    eos = sorted(tok.eos_token_ids)[0]
    assert heal_prompt([*tok.encode("Hi there"), eos], vocab).removed == ""
    assert heal_prompt(tok.encode("x"), vocab).removed == ""  # one token: nothing left to prefill


def test_url_example_heals_to_the_tokenizers_own_tokenisation(smollm, smollm_generator, vocab):
    tok = smollm.tokenizer
    healed = heal_prompt(tok.encode(URL_PROMPT), vocab)
    out = smollm_generator.generate([Request(URL_PROMPT, SamplingParams(temperature=0, max_tokens=8), token_healing=True)],
                                    ledger=Ledger())[0][0]
    full = URL_PROMPT[:len(URL_PROMPT) - len(healed.removed)] + out.text
    assert full.startswith("The url is http://"), full
    assert full[len("The url is "):].startswith("http://")
    # the first token is the vocabulary's "://", as the tokenizer tokenises the final text
    assert tok.decode([out.token_ids[0]]) == "://"
    assert tok.encode(full)[:len(healed.ids) + 1] == [*healed.ids, out.token_ids[0]]
    # without healing the model must continue after ":" (the tokenisation it rarely saw)
    plain = smollm_generator.generate([Request(URL_PROMPT, SamplingParams(temperature=0, max_tokens=8))],
                                      ledger=Ledger())[0][0]
    assert not (URL_PROMPT + plain.text).startswith("The url is http://")


def test_sampled_healed_outputs_all_extend_the_removed_text(smollm_generator):
    params = SamplingParams(temperature=1.2, n=12, seed=0, max_tokens=4)
    ledger = Ledger()
    out = smollm_generator.generate([Request(URL_PROMPT, params, token_healing=True)], ledger=ledger)[0]
    for c in out:
        assert c.text.startswith(":"), c.text
    assert ledger.usage.input_tokens == 4  # the prompt minus its last token


def test_healing_composes_with_a_regex(smollm, smollm_generator, vocab):
    prompt, pattern = "Call me at 555-", r"[0-9]{3}-[0-9]{4}"
    healed = heal_prompt(smollm.tokenizer.encode(prompt), vocab)
    assert healed.removed
    params = SamplingParams(temperature=1.0, n=8, seed=2, max_tokens=12)
    out = smollm_generator.generate([Request(prompt, params, token_healing=True, constraint=ConstraintSpec.regex(pattern))],
                                    ledger=Ledger())[0]
    for c in out:
        assert c.finish_reason == "stop"
        assert c.text.startswith(healed.removed), c.text
        assert re.fullmatch(pattern, c.text[len(healed.removed):]), c.text


def test_healing_composes_with_choices_across_the_boundary(smollm_generator):
    out = smollm_generator.generate([Request(URL_PROMPT, SamplingParams(temperature=0, max_tokens=8), token_healing=True,
                                             constraint=ConstraintSpec.choices(["//a.org", "//b.com"]))], ledger=Ledger())[0][0]
    assert out.text in (":" + "//a.org", ":" + "//b.com")


def test_healing_cursor_mask_advance_rollback_fork(smollm, vocab):
    tok = smollm.tokenizer
    cursor = HealingCursor(vocab, b":")
    mask = cursor.mask()
    colon, slashes, letter = tok.token_to_id(":"), tok.token_to_id("://"), tok.token_to_id("a")
    assert mask[colon] and mask[slashes] and not mask[letter]
    assert not mask[sorted(vocab.eos)].any()
    child = cursor.fork()
    cursor.advance(slashes)
    assert cursor.unconstrained and cursor.mask().all()
    assert not child.unconstrained and torch.equal(child.mask(), mask)
    cursor.rollback(1)
    assert torch.equal(cursor.mask(), mask)
    with pytest.raises(InvalidParameter):
        cursor.advance(letter)
    # a multi-token removed text: a token that is a proper prefix leaves the rest to produce
    wide = HealingCursor(vocab, b" wor")
    space = tok.token_to_id("Ġ")
    assert wide.mask()[space] and wide.mask()[tok.token_to_id("Ġworld")]
    wide.advance(space)
    assert wide.remaining == b"wor" and wide.mask()[tok.token_to_id("world")]
