"""Speculator heads (hierarchical Medusa-style): training on a tiny model, the file format, the
shipped heads for the default model, and exactness of greedy speculative decoding with them."""

import itertools
import json

import pytest
import torch

from metaloom.errors import InvalidParameter, NoSpeculatorHeads, NotAModel, UnsupportedModel
from metaloom.generator import LocalGenerator, Request, TokenIds
from metaloom.ledger import Ledger
from metaloom.models.engine.config import LlamaConfig
from metaloom.models.engine.llama import LlamaModel
from metaloom.models.load import LoadedModel
from metaloom.sampling import SamplingParams
from metaloom.sampling.pipeline import make_sampler
from metaloom.speculative import Speculative
from metaloom.speculative.drafters.heads import HeadsDrafter
from metaloom.speculative.heads import DEFAULT_FILE, load_heads, save_heads
from metaloom.speculative.heads.data import Example, hidden_states
from metaloom.speculative.heads.model import HeadsConfig, matches, model_probe, model_signature, read_config
from metaloom.speculative.heads.train import TrainConfig, evaluate, train


class _Tok:
    """Token ids as text (the tiny model has no tokenizer)."""

    eos_token_ids = frozenset()

    def decode(self, ids):
        return " ".join(map(str, ids))

    def encode(self, text, add_special_tokens=True):
        return [int(t) for t in text.split()]


def _tiny_model(seed=0, vocab=97, d=64, layers=2):
    """A random Llama-family model with weights of a trained model's scale (peaked next-token
    distributions), built without transformers (fast)."""
    g = torch.Generator().manual_seed(seed)
    config = LlamaConfig(model_type="llama", vocab_size=vocab, hidden_size=d, intermediate_size=2 * d,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=d // 4,
                         rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=256, tie_word_embeddings=False,
                         attention_bias=False)

    def w(*shape, std=d ** -0.5):
        return torch.randn(*shape, generator=g) * std

    sd = {"model.embed_tokens.weight": w(vocab, d, std=1.0), "model.norm.weight": torch.ones(d),
          "lm_head.weight": w(vocab, d, std=0.4)}
    for i in range(layers):
        p = f"model.layers.{i}."
        sd |= {p + "self_attn.q_proj.weight": w(d, d), p + "self_attn.k_proj.weight": w(d // 2, d),
               p + "self_attn.v_proj.weight": w(d // 2, d), p + "self_attn.o_proj.weight": w(d, d),
               p + "mlp.gate_proj.weight": w(2 * d, d), p + "mlp.up_proj.weight": w(2 * d, d),
               p + "mlp.down_proj.weight": w(d, 2 * d), p + "input_layernorm.weight": torch.ones(d),
               p + "post_attention_layernorm.weight": torch.ones(d)}
    return LlamaModel.from_state_dict(config, sd)


def _engine(model, tokenizer, drafter=None, num_draft=4):
    loaded = LoadedModel(model=model, tokenizer=tokenizer, name="tiny", folder="", dtype=torch.float32)
    return LocalGenerator(loaded, speculative=None if drafter is None else Speculative(drafter, num_draft))


def _greedy(model, prompt, n):
    """Plain greedy continuation of ``prompt`` (list of ids) by ``n`` tokens."""
    request = Request(TokenIds(tuple(prompt)), SamplingParams(temperature=0.0, max_tokens=n))
    return list(_engine(model, _Tok()).generate([request], ledger=Ledger())[0][0].token_ids)


def _speculative(model, tokenizer, prompt, n, drafter, num_draft=4, eos=True):
    out, usage = _speculative_batch(model, tokenizer, [prompt], [n], drafter, num_draft, eos)
    return out[0], usage


def _speculative_batch(model, tokenizer, prompts, lengths, drafter, num_draft=4, eos=True):
    """Greedy speculative decoding of several rows in one batch; row r stops after lengths[r] tokens."""
    ledger = Ledger()
    requests = [Request(TokenIds(tuple(p)), SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=not eos))
                for p, n in zip(prompts, lengths, strict=True)]
    outs = _engine(model, tokenizer, drafter, num_draft).generate(requests, ledger=ledger)
    return [list(o[0].token_ids) for o in outs], ledger.usage


@pytest.fixture(scope="module")
def tiny():
    model = _tiny_model()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 97, (6,), generator=g).tolist() for _ in range(16)]
    tokens = torch.tensor(prompts)
    cache = model.new_cache(len(prompts), 6 + 32)
    logits = model.forward(tokens, cache)[:, -1]
    for _ in range(32):  # batched greedy continuation (rows of equal length)
        nxt = logits.argmax(dim=-1, keepdim=True)
        tokens = torch.cat([tokens, nxt], dim=1)
        logits = model.forward(nxt, cache)[:, -1]
    sequences = tokens.tolist()
    hidden, greedy = hidden_states(model, sequences)
    assert all(torch.equal(g[5:-1], torch.tensor(s[6:])) for s, g in zip(sequences, greedy, strict=True))
    examples = [Example(torch.tensor(s), h, 5, g) for s, h, g in zip(sequences, hidden, greedy, strict=True)]
    return model, examples


def test_forward_hidden_matches_forward(tiny):
    model, _ = tiny
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(3))
    logits = model.forward(ids, model.new_cache(2, 16))
    logits2, hidden = model.forward_hidden(ids, model.new_cache(2, 16))
    assert torch.equal(logits, logits2)
    assert hidden.shape == (2, 9, 64)
    assert torch.allclose(hidden @ model.lm_head.T, logits, atol=1e-5)


def test_training_runs_end_to_end_and_lowers_the_loss(tiny, tmp_path):
    model, examples = tiny
    config = TrainConfig(stages=3, inner_size=32, draft_vocab=64, phase1_steps=30, phase2_steps=60, phase1_batch=4,
                         phase2_batch=16, window=8, lr1=3e-3, lr2=2e-3, warmup=5, autocast=False)
    identity = HeadsConfig(0, 0, 0, 0, 0, model_name="tiny", signature=model_signature(model), probe=model_probe(model))
    heads, report = train(examples[4:], examples[4:], model.embed, model.lm_head, config, identity)
    assert len(report.phase1_loss) == 30 and len(report.phase2_loss) == 60
    first = sum(report.phase1_loss[:5]) / 5
    last = sum(report.phase2_loss[-10:]) / 10
    assert last < 0.7 * first, (first, last)
    scores = evaluate(heads, examples[:4], model.embed, model.lm_head)
    assert scores["positions"] > 0 and 0 <= scores["mean_accepted"] <= 3
    # the file round-trips, with its header
    path = str(tmp_path / "tiny.safetensors")
    save_heads(heads, path, dtype=torch.float32)
    header = read_config(path)
    assert header.stages == 3 and header.model_name == "tiny" and header.draft_vocab == len(heads.vocab_ids)
    loaded = load_heads(path)
    assert matches(loaded.config, model)
    z, first_tok = examples[0].hidden[5:9].float(), examples[0].tokens[6:10]
    head = model.lm_head[heads.vocab_ids].float()
    assert torch.equal(loaded.draft(z, first_tok, 3, model.embed, head), heads.draft(z, first_tok, 3, model.embed, head))
    # confidence cut: with min_prob 0 every stage counts; otherwise the leading stages whose
    # guess has at least that probability (computed here by hand)
    drafted, full = heads.draft_confident(z, first_tok, 3, model.embed, head, 0.0)
    assert torch.equal(drafted, heads.draft(z, first_tok, 3, model.embed, head)) and full.tolist() == [3] * 4
    state, tok, probs = z, first_tok, []
    with torch.no_grad():
        for i in range(3):
            state = heads.stage(i, state, model.embed[tok].float())
            p = torch.softmax((heads.out[i](state) @ head.T).float(), dim=-1)
            probs.append(p.max(dim=-1).values)
            tok = heads.vocab_ids[p.argmax(dim=-1)]
    probs_t = torch.stack(probs, dim=1)  # [4 rows, 3 stages]
    # thresholds between the probabilities, never on one: the kernel and this test form p(best)
    # in different orders (best - logsumexp against softmax's max), so a threshold equal to a
    # probability tests their rounding, which fell one way on AVX2 and the other on AVX-512
    values = sorted(set(probs_t.flatten().tolist()))
    between = [(a + b) / 2 for a, b in itertools.pairwise(values) if b - a > 1e-4]
    assert len(between) >= 3, values
    for t in (values[0] / 2, *between, values[-1] + 1e-3):
        _, cut = heads.draft_confident(z, first_tok, 3, model.embed, head, t)
        assert cut.tolist() == (probs_t >= t).long().cumprod(dim=1).sum(dim=1).tolist()
    with pytest.raises(InvalidParameter):
        HeadsDrafter(min_prob=1.0)
    # the drafter with these heads decodes exactly as plain greedy
    for e in examples[:3]:
        prompt = e.tokens[:e.start + 1].tolist()
        out, usage = _speculative(model, _Tok(), prompt, 30, HeadsDrafter(path=path, min_prob=0.0), num_draft=3)
        assert out == _greedy(model, prompt, 30)
        assert usage.drafted_tokens > 0
        cut, _ = _speculative(model, _Tok(), prompt, 30, HeadsDrafter(path=path, min_prob=0.5), num_draft=3)
        assert cut == out  # shorter drafts, same tokens
    # a batch whose rows accept different counts and finish at different steps (finished rows are dropped)
    prompts = [e.tokens[:e.start + 1].tolist() for e in examples[:4]]
    outs, usage = _speculative_batch(model, _Tok(), prompts, [30, 7, 22, 30], HeadsDrafter(heads=heads), num_draft=3)
    assert outs == [_greedy(model, p, n) for p, n in zip(prompts, [30, 7, 22, 30], strict=True)]
    assert usage.accepted_tokens > 0


def test_no_heads_for_an_unknown_model_is_a_typed_error(tiny):
    model, _ = tiny
    sampler = make_sampler([SamplingParams(temperature=0.0)], model.vocab_size, model.device)
    with pytest.raises(NoSpeculatorHeads, match="train-speculator"):
        HeadsDrafter().start(model, sampler, [[1, 2]], [None])


def test_not_a_heads_file(tmp_path):
    from safetensors.torch import save_file

    path = str(tmp_path / "x.safetensors")
    save_file({"a": torch.zeros(2)}, path)
    with pytest.raises(NotAModel):
        read_config(path)


# --- the default model ----------------------------------------------------------------------------

PROMPTS = [
    "Explain in two sentences why the sky is blue.",
    "Write a Python function that reverses a list.",
    "Give me three tips for sleeping better.",
    "zq xv 1973 !! ## purple ??",  # nonsense: drafts are mostly rejected
]


@pytest.mark.model
def test_shipped_heads_match_the_default_model_and_are_small(smollm):
    config = read_config(DEFAULT_FILE)
    assert matches(config, smollm.model)
    import os

    assert os.path.getsize(DEFAULT_FILE) < 8 * 2**20


@pytest.mark.model
def test_heads_need_the_native_model(smollm):
    from metaloom.testing.toy_models import MarkovModel

    toy = MarkovModel.random(8)
    sampler = make_sampler([SamplingParams(temperature=0.0)], 8, toy.device)
    with pytest.raises(UnsupportedModel):
        HeadsDrafter().start(toy, sampler, [[1]], [None])


@pytest.mark.model
@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_with_shipped_heads_equals_plain_greedy(smollm, prompt):
    tok, model = smollm.tokenizer, smollm.model
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": prompt}]), add_special_tokens=False)
    out, usage = _speculative(model, tok, ids, 32, HeadsDrafter(), num_draft=4, eos=False)
    assert out == _greedy(model, ids, 32)
    assert usage.drafted_tokens > 0
    if prompt == PROMPTS[0]:  # a real prompt: the shipped heads are accepted
        assert usage.accepted_tokens > 0


@pytest.mark.model
def test_train_speculator_command_end_to_end(smollm, tmp_path, capsys):
    from metaloom.cli import main

    out = tmp_path / "heads.safetensors"
    assert main(["train-speculator", "--samples", "4", "--max-tokens", "32", "--documents", "2", "--steps", "4",
                 "--grounded", "3", "--sampled", "2", "--out", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["stages"] == 4 and report["heldout"]["positions"] > 0 and out.exists()
    # 4 greedy answers + 3 grounded ones; 2 sampled answers to each of the 7 prompts
    assert report["answers"] == 7
    assert matches(read_config(str(out)), smollm.model)


def test_grounded_prompts_quote_the_given_texts():
    from metaloom.speculative.heads.data import grounded_prompts

    texts = ["short", "A long enough answer about honey bees, which dance to tell each other where the flowers are."]
    prompts = grounded_prompts(texts, 5, seed=1)
    assert len(prompts) == 5 and all(texts[1] in p for p in prompts)  # too-short texts are never quoted
    assert grounded_prompts(texts, 5, seed=1) == prompts  # seeded
    assert grounded_prompts(["tiny"], 3) == []


def test_heads_keep_the_hidden_state_of_each_rows_last_kept_position():
    """After a verify, row b drafts next from the hidden state at its last kept position
    (``accepted[b]``); after a plain step (one position a row) from that position, read as a
    view. Either way a wrong row or position would draft from another context."""
    from metaloom.speculative.drafter import Draft, Verified
    from metaloom.speculative.drafters.heads import HeadsState

    state = HeadsState(heads=None, embed=None, head=torch.zeros(1, 4), hidden=None, rows=2)  # type: ignore[arg-type]
    hidden = torch.arange(2 * 3 * 4, dtype=torch.float32).reshape(2, 3, 4)
    drafted = Draft.from_lists([[5, 6], [7, 8]])
    state.observe(Verified(draft=drafted, logits=torch.zeros(2, 3, 9), accepted=torch.tensor([2, 0]),
                           tokens=torch.zeros(2, 3, dtype=torch.long), hidden=hidden))
    assert torch.equal(state.hidden, torch.stack([hidden[0, 2], hidden[1, 0]]))
    plain = hidden[:, 1:2]
    state.observe(Verified(draft=Draft.from_lists([[], []]), logits=torch.zeros(2, 1, 9), accepted=torch.tensor([0, 0]),
                           tokens=torch.zeros(2, 1, dtype=torch.long), hidden=plain))
    assert torch.equal(state.hidden, hidden[:, 1]) and state.rows == 2


@pytest.mark.parametrize("activations", ["float", "q8"])
@pytest.mark.parametrize("ids", [[7, 3, 79, 0, 21], list(range(16))])
def test_draft_head_multiplies_the_targets_own_quantised_rows(activations, ids):
    """A quantised LM head's draft-vocabulary rows stay its blocks (no float copy): row i of
    the draft head is row ids[i] of the target's head, by the same kernel, to the bit; a count
    of rows that is not a whole panel is padded for the kernel and cut back. A dense head gives
    its rows as a tensor, as before."""
    from metaloom.models.engine.weights import linear
    from metaloom.models.kernels.quant import quantize
    from metaloom.speculative.drafters.heads import draft_head

    gen = torch.Generator().manual_seed(0)
    w = quantize(torch.randn(80, 64, generator=gen), "Q8_0").with_activations(activations).panelled()
    index = torch.tensor(ids)
    head = draft_head(w, index)
    for rows in (1, 3):
        x = torch.randn(rows, 64, generator=gen)
        got = linear(x, head)
        assert got.shape == (rows, len(ids))
        assert torch.equal(got, w(x)[:, index])
    dense = torch.randn(80, 64, generator=gen)
    assert torch.equal(draft_head(dense, index), dense[index])


@pytest.mark.model
def test_heads_make_their_draft_head_once_per_target(smollm):
    """Each request's `start` of one drafter (as a generator keeps it) reuses the draft head made
    for this target and these heads (a gather of megabytes each request otherwise)."""
    model = smollm.model
    sampler = make_sampler([SamplingParams(temperature=0.0)], model.vocab_size, model.device)
    drafter = HeadsDrafter()
    first = drafter.start(model, sampler, [[1]], [None])
    again = drafter.start(model, sampler, [[1, 2]], [None])
    assert again.head is first.head
    x = torch.randn(2, model.config.hidden_size)
    from metaloom.models.engine.weights import linear

    assert linear(x, first.head).shape == (2, first.heads.config.draft_vocab)
