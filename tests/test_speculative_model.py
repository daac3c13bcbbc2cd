"""Greedy speculative decoding on the real default model equals plain greedy token for token,
for every drafter, on prompts where drafts are mostly accepted and where they are mostly
rejected; batches, constraints and the CLI's speculative flags."""

import json

import pytest
import torch

from metaloom.generator import LocalGenerator, Request
from metaloom.ledger import Ledger
from metaloom.sampling import SamplingParams
from metaloom.speculative import Draft, Speculative
from metaloom.speculative.drafters.draft_model import DraftModelDrafter
from metaloom.speculative.drafters.jacobi import JacobiDrafter
from metaloom.speculative.drafters.ngram import NgramDrafter
from metaloom.speculative.drafters.quantized import QuantizedLlama, quantized_drafter

CODE = '''def mean(values):
    """Return the arithmetic mean of a list of numbers."""
    total = 0
    for value in values:
        total += value
    return total / len(values)
'''
PROMPTS = {
    "copy-heavy edit": f"Rename the function `mean` to `average` in this code and output the whole code.\n\n{CODE}",
    "open-ended": "Write one sentence about a red fox.",
    "list": "List three prime numbers.",
}
MAX_TOKENS = 32


class RandomDrafter:
    """Drafts random tokens: nearly everything is rejected."""

    name = "random"

    def start(self, target, sampler, contexts, keys):
        self.g = torch.Generator().manual_seed(0)
        self.vocab = target.vocab_size
        return self

    def propose(self, contexts, limits, ledger):
        return Draft.from_lists([torch.randint(self.vocab, (n,), generator=self.g).tolist() for n in limits])

    def observe(self, verified):
        pass

    def select(self, rows):
        return self


@pytest.fixture(scope="module")
def reference(smollm_generator):
    reqs = [Request.chat(p, SamplingParams(temperature=0, max_tokens=MAX_TOKENS)) for p in PROMPTS.values()]
    return reqs, smollm_generator.generate(reqs, ledger=Ledger())


@pytest.fixture(scope="module")
def int8(smollm):
    return quantized_drafter(smollm.model, 8)


def _drafters(smollm, int8):
    return {
        "ngram": (NgramDrafter(), 8),
        "draft model (int4 copy of the target)": (DraftModelDrafter(QuantizedLlama(smollm.model, 4)), 3),
        "quantized int8": (int8, 4),
        "jacobi": (JacobiDrafter(), 4),
        "jacobi + lookup": (JacobiDrafter(fill="lookup"), 4),
        "random (mostly rejected)": (RandomDrafter(), 4),
    }


def test_every_drafter_equals_plain_greedy(smollm, int8, reference):
    reqs, expected = reference
    rates = {}
    for name, (drafter, k) in _drafters(smollm, int8).items():
        gen = LocalGenerator(smollm, speculative=Speculative(drafter, k))
        for req, want in zip(reqs, expected, strict=True):
            ledger = Ledger()
            got = gen.generate([req], ledger=ledger)[0]
            assert [c.token_ids for c in got] == [c.token_ids for c in want], (name, req.prompt)
            assert got[0].finish_reason == want[0].finish_reason
            rates[name, req.prompt[0]["content"][:10]] = ledger.usage.acceptance_rate
    assert all(r is not None and r < 0.05 for (name, _), r in rates.items() if name.startswith("random"))
    edit = PROMPTS["copy-heavy edit"][:10]
    assert rates["ngram", edit] > 0.2  # the edit copies its input: prompt lookup is accepted often (0.29 measured)
    assert rates["quantized int8", edit] > 0.6


def test_batched_rows_of_different_lengths_equal_plain(smollm, reference):
    reqs, expected = reference
    gen = LocalGenerator(smollm, speculative=Speculative(NgramDrafter(), 6))
    ledger = Ledger()
    got = gen.generate(reqs, ledger=ledger)
    assert [c[0].token_ids for c in got] == [c[0].token_ids for c in expected]
    assert ledger.usage.verify_steps > 0


def test_constrained_greedy_equals_plain(smollm, smollm_generator):
    from metaloom.constrain import ConstraintSpec

    req = Request.chat("Give a JSON object with a name and an age.",
                       SamplingParams(temperature=0, max_tokens=30),)
    req = Request(req.prompt, req.params, constraint=ConstraintSpec.regex(r'\{"name": "[A-Za-z ]+", "age": [0-9]+\}'))
    want = smollm_generator.generate([req], ledger=Ledger())[0][0]
    gen = LocalGenerator(smollm, speculative=Speculative(JacobiDrafter(fill="lookup"), 4))
    got = gen.generate([req], ledger=Ledger())[0][0]
    assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason


def test_cli_speculative_json_reports_the_counters(capsys):
    from metaloom.cli import main

    code = main(["generate", "Repeat exactly: one two three four five six seven eight.", "--temperature", "0",
                 "--max-tokens", "16", "--speculative", "ngram", "--num-draft", "4", "--cost-model", "off", "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    spec = report["speculative"]
    assert spec["drafter"] == "ngram" and spec["num_draft"] == 4
    usage = report["usage"]
    assert usage["drafted_tokens"] == usage["accepted_tokens"] + usage["rejected_tokens"]
    assert usage["drafted_tokens"] > 0  # the prompt repeats itself: prompt lookup finds drafts
    assert spec["acceptance_rate"] == pytest.approx(usage["accepted_tokens"] / usage["drafted_tokens"])


def test_cli_auto_reports_the_cost_models_choices(capsys):
    from metaloom.cli import main

    code = main(["generate", "Repeat exactly: one two three four five six seven eight.", "--temperature", "0",
                 "--max-tokens", "12", "--speculative", "auto", "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    spec = report["speculative"]
    assert spec["drafter"] == "auto"
    model = spec["cost_model"]
    assert model["verify_cost"]["widths"][0] == 1 and model["verify_cost"]["relative"][0] == 1.0
    assert {"ngram", "recycling", "heads"} <= set(model["drafters"])  # the default model ships heads
    verified = sum(int(k) * v for k, v in model["nodes_verified"].items())
    assert verified == report["usage"]["drafted_tokens"]  # every verified node is a drafted token
    assert sum(d["kept"] for d in model["drafters"].values()) == report["usage"]["accepted_tokens"]
    assert sum(model["nodes_verified"].values()) == report["usage"]["verify_steps"]


@pytest.mark.parametrize(("flags", "message"), [
    (["--speculative", "auto", "--cost-model", "off"], "cost_model"),
    (["--speculative", "auto", "--tree", "static:2,1"], "tree"),
])
def test_cli_refuses_auto_without_its_cost_model_or_with_a_tree(flags, message, capsys):
    from metaloom.cli import main

    code = main(["generate", "hi", "--max-tokens", "2", *flags])
    assert code != 0
    assert message in capsys.readouterr().err
