"""A row the sampling pipeline leaves no token (every token banned) ends with an error that says
why, after the tokens it had, and the other rows of its batch go on (`metaloom.decode.select`:
`Drawn.failures` from each row's largest log-probability, read back with the tokens)."""

from __future__ import annotations

import torch

from metaloom.generator import LocalGenerator, Request
from metaloom.ledger import Ledger
from metaloom.models.load import LoadedModel
from metaloom.sampling import SamplingParams
from metaloom.testing.toy_models import CharTokenizer, MarkovModel


def test_a_row_left_no_token_ends_in_an_error_and_its_batch_goes_on():
    vocab = 5
    gen = LocalGenerator(LoadedModel(model=MarkovModel.random(vocab, seed=3), tokenizer=CharTokenizer(vocab),
                                     name="toy", folder="", dtype=torch.float32))
    # no_repeat_ngram_size=1 bans every token seen, prompt included: after the 3 tokens the
    # prompt "ab" leaves, nothing can be drawn
    banned = Request(prompt="ab", params=SamplingParams(temperature=0, max_tokens=8, no_repeat_ngram_size=1))
    free = Request(prompt="ab", params=SamplingParams(temperature=0, max_tokens=8))
    dead, alive = (c[0] for c in gen.generate([banned, free], ledger=Ledger()))
    assert dead.finish_reason == "error" and "every token is excluded by the sampling pipeline" in (dead.error or "")
    assert len(dead.token_ids) == 3 and set(dead.token_ids) == {2, 3, 4}  # each token once, then none left
    assert alive.finish_reason == "length" and len(alive.token_ids) == 8 and alive.error is None
