"""Process reward models as step scorers (`metaloom.score.prm`, `metaloom.models.scorers.prm`): tiny
random models in both public conventions, saved locally, against transformers run by hand on
one unpadded input per partial solution."""

import functools
import importlib
import json
import shutil
import sys
import types
import typing

import pytest
import torch

from metaloom.errors import ContextWindowExceeded, InvalidParameter, ModelNotFound, NotAModel, UnsupportedModel
from metaloom.ledger import Ledger
from metaloom.score.prm import ProcessRewardModel
from metaloom.score.protocols import StepScorer

SYSTEM = "Please reason step by step, and put your final answer within \\boxed{}."
SEP, TAG = "<extra_0>", "ки"
WORDS = ["system", "user", "assistant", "Please", "reason", "step", "by", ",", "what", "is", "two", "plus", "times",
         "three", "four", "five", "six", "it", "maybe", "so", "the", "answer", "?", ".", "+", "-", TAG]
TAG_VOCAB = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", "\n"] + [p + w for w in WORDS for p in ("", "▁")])}
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

QUESTION = "what is two plus two ?"
PARTIALS = [  # different numbers of steps and lengths (padding), an empty partial in the middle
    ["two plus two is four .\n\n"],
    ["two plus two\n\n", "is four\n\n", "so the answer is four ."],
    [],
    ["maybe five\n", "it is five .\n\n"],
    ["two times three is six ?\n\n", "so", "the answer is four", "four\n\n"],
]

# the Qwen2.5-Math-PRM-style head, as the model's own code in its folder (trust_remote_code)
REMOTE_CONFIG = '''
from transformers import Qwen2Config


class TinyRMConfig(Qwen2Config):
    model_type = "qwen2"
'''
REMOTE_MODEL = '''
from torch import nn
from transformers import Qwen2PreTrainedModel, Qwen2Model
from transformers.modeling_outputs import TokenClassifierOutput

from .configuration_tiny_rm import TinyRMConfig


class Qwen2ForProcessRewardModel(Qwen2PreTrainedModel):
    config_class = TinyRMConfig

    def __init__(self, config):
        super().__init__(config)
        self.model = Qwen2Model(config)
        self.score = nn.Sequential(nn.Linear(config.hidden_size, config.hidden_size), nn.ReLU(),
                                   nn.Linear(config.hidden_size, 2))
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, **kwargs):
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return TokenClassifierOutput(logits=self.score(hidden))
'''


def _sentencepiece_like_tokenizer(folder):
    """A word-level tokenizer that marks a preceding space ("▁two" vs "two", as Mistral's
    sentencepiece tokenizer does, with its dummy prefix on the first word) and adds a BOS."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(TAG_VOCAB, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex("\n"), behavior="isolated"),
                                                 pre_tokenizers.Metaspace(prepend_scheme="first")])
    tok.decoder = decoders.Metaspace(prepend_scheme="first")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", TAG_VOCAB["<s>"])])
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>").save_pretrained(folder)


@functools.cache
def _byte_level_bpe(separator: bool):
    """A small byte-level BPE in Qwen2's format (transformers 5 rebuilds a qwen2 model's
    tokenizer as `Qwen2Tokenizer` from tokenizer.json's vocabulary and merges)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + ([SEP] if separator else [])
    corpus = [SYSTEM, QUESTION, "system user assistant", " ".join(WORDS), *("\n\n".join(p) for p in PARTIALS)] * 3
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=special, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok, special


def _qwen_tokenizer(folder, *, chat_template=True, separator=True):
    from transformers import PreTrainedTokenizerFast

    tok, special = _byte_level_bpe(separator)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=special[1:])
    if chat_template:
        fast.chat_template = TEMPLATE
    fast.save_pretrained(folder)
    return tok.get_vocab_size()


def _randomize(model, seed):
    """Weights large enough that the probabilities spread well away from 0.5."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            else:
                p.copy_((1.0 if "norm" in name else 0.0) + 0.3 * torch.randn(p.shape, generator=gen))
    return model.eval()


def _qwen_config(**kw):
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=_byte_level_bpe(True)[0].get_vocab_size(), hidden_size=32, intermediate_size=64,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, **kw)


def SEP_ID():
    """The separator's id in the Qwen-style test tokenizer, from the tokenizer as built."""
    return _byte_level_bpe(True)[0].token_to_id(SEP)


def _load_remote_class(folder):
    """The folder's own model class, imported directly (not through transformers' remote code)."""
    name = f"tiny_prm_reference_{folder.name}"
    if name not in sys.modules:
        package = types.ModuleType(name)
        package.__path__ = [str(folder)]
        sys.modules[name] = package
    return importlib.import_module(f"{name}.modeling_tiny_rm").Qwen2ForProcessRewardModel


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """name -> folder of a tiny random PRM (and a few that are not PRMs)."""
    from transformers import MistralConfig, MistralForCausalLM, Qwen2ForTokenClassification

    out = {}
    # classification convention: transformers' own token classifier, two labels, chat template
    out["token2"] = tmp_path_factory.mktemp("token2")
    _randomize(Qwen2ForTokenClassification(_qwen_config(num_labels=2)), 1).save_pretrained(out["token2"])
    _qwen_tokenizer(out["token2"])
    # one label (sigmoid), no chat template
    out["token1"] = tmp_path_factory.mktemp("token1")
    _randomize(Qwen2ForTokenClassification(_qwen_config(num_labels=1)), 2).save_pretrained(out["token1"])
    _qwen_tokenizer(out["token1"], chat_template=False)
    # Qwen2ForProcessRewardModel through its own code, as Qwen/Qwen2.5-Math-PRM-7B's folder has it
    out["remote"] = folder = tmp_path_factory.mktemp("remote")
    (folder / "configuration_tiny_rm.py").write_text(REMOTE_CONFIG)
    (folder / "modeling_tiny_rm.py").write_text(REMOTE_MODEL)
    model_class = _load_remote_class(folder)
    config = model_class.config_class(**_qwen_config().to_dict())
    _randomize(model_class(config), 3).save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForProcessRewardModel"]
    config["auto_map"] = {"AutoConfig": "configuration_tiny_rm.TinyRMConfig",
                          "AutoModel": "modeling_tiny_rm.Qwen2ForProcessRewardModel"}
    (folder / "config.json").write_text(json.dumps(config))
    _qwen_tokenizer(folder)
    # tag convention (Math-Shepherd): a causal LM
    out["tag"] = tmp_path_factory.mktemp("tag")
    mistral = MistralConfig(vocab_size=len(TAG_VOCAB), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    _randomize(MistralForCausalLM(mistral), 4).save_pretrained(out["tag"])
    _sentencepiece_like_tokenizer(out["tag"])
    # a token classifier whose tokenizer has no "<extra_0>"
    out["nosep"] = tmp_path_factory.mktemp("nosep")
    shutil.copy(out["token2"] / "config.json", out["nosep"])
    shutil.copy(out["token2"] / "model.safetensors", out["nosep"])
    _qwen_tokenizer(out["nosep"], separator=False)
    return out


def _classification_reference(model, question, steps, *, chat):
    """The Qwen2.5-Math-PRM model card's computation, on one unpadded input."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(chat)
    answer = "".join(s.rstrip() + SEP for s in steps)
    text = (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n"
            f"<|im_start|>assistant\n{answer}<|im_end|>\n")
    ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    probs = torch.softmax(logits, dim=-1)[0, :, 1]
    return probs[ids[0] == SEP_ID()].tolist()


@pytest.mark.parametrize("name", ["token2", "remote"])
def test_classification_convention_matches_unpadded_transformers(folders, name):
    from transformers import AutoModelForTokenClassification

    folder = folders[name]
    model = (_load_remote_class(folder) if name == "remote" else AutoModelForTokenClassification).from_pretrained(folder)
    model.eval()
    prm = ProcessRewardModel.load(str(folder), batch_size=2)
    assert isinstance(prm, StepScorer) and prm.name == "prm" and prm.model.convention == "classification"
    ledger = Ledger()
    scores = prm.score_steps(QUESTION, PARTIALS, ledger=ledger)
    assert [len(s) for s in scores] == [len(p) for p in PARTIALS]
    for steps, got in zip(PARTIALS, scores, strict=True):
        want = _classification_reference(model, QUESTION, steps, chat=folder) if steps else []
        assert got == pytest.approx(want, abs=1e-5)
        assert all(0.0 <= p <= 1.0 for p in got)
    flat = [p for s in scores for p in s]
    assert max(flat) - min(flat) > 0.05  # the weights really discriminate the steps
    assert ledger.usage.scorer_calls == 1 and ledger.usage.seconds > 0 and ledger.usage.input_tokens == 0
    # a chat prompt is read as its last user message; last_only still gives every step
    chat = ({"role": "system", "content": "be brief"}, {"role": "user", "content": QUESTION})
    assert prm.score_steps(chat, PARTIALS[1:2], ledger=ledger, last_only=True)[0] == pytest.approx(scores[1], abs=1e-6)
    assert ledger.usage.scorer_calls == 2


def test_one_label_token_classifier_reads_the_sigmoid_without_a_chat_template(folders):
    from transformers import AutoModelForTokenClassification, AutoTokenizer

    folder = folders["token1"]
    model = AutoModelForTokenClassification.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prm = ProcessRewardModel.load(str(folder), convention="classification", batch_size=3)
    scores = prm.score_steps(QUESTION, PARTIALS, ledger=Ledger())
    for steps, got in zip(PARTIALS, scores, strict=True):
        if not steps:
            assert got == []
            continue
        text = QUESTION + "\n\n" + "".join(s.rstrip() + SEP for s in steps)
        ids = torch.tensor([tokenizer(text)["input_ids"]])
        with torch.no_grad():
            want = torch.sigmoid(model(input_ids=ids).logits[0, :, 0])[ids[0] == SEP_ID()].tolist()
        assert got == pytest.approx(want, abs=1e-5)


def test_tag_convention_matches_math_shepherd_reading(folders):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = folders["tag"]
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prm = ProcessRewardModel.load(str(folder), batch_size=2)
    assert prm.model.convention == "tag"
    ledger = Ledger()
    # a step that already ends with the tag (a Math-Shepherd-style policy) is not tagged twice
    partials = [*PARTIALS, ["two plus two is four ки\n", "so the answer is four . ки"]]
    scores = prm.score_steps(QUESTION, partials, ledger=ledger)
    assert [len(s) for s in scores] == [len(p) for p in partials]
    # Math-Shepherd's README: candidate_tokens = encode(f"{good} {bad}")[1:], step_tag_id = encode(step_tag)[-1]
    candidates = tokenizer.encode("+ -")[1:]
    step_tag_id = tokenizer.encode(TAG)[-1]
    assert candidates == [TAG_VOCAB["▁+"], TAG_VOCAB["▁-"]] and step_tag_id == TAG_VOCAB["▁ки"]
    for steps, got in zip(partials, scores, strict=True):
        if not steps:
            assert got == []
            continue
        output = "\n".join(s.rstrip().removesuffix(TAG).rstrip() + " " + TAG for s in steps)
        ids = torch.tensor([tokenizer(f"{QUESTION} {output}")["input_ids"]])
        assert ids[0, 0] == TAG_VOCAB["<s>"] and TAG_VOCAB["<unk>"] not in ids
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0][:, candidates]
        want = logits.softmax(dim=-1)[:, 0][ids[0] == step_tag_id].tolist()
        assert len(want) == len(steps)
        assert got == pytest.approx(want, abs=1e-5)
    assert ledger.usage.scorer_calls == 1


def test_load_signature_is_settable_from_text():
    """The registry entry "metaloom.score.prm:ProcessRewardModel.load" is configured from the
    command line: a folder parameter called path, and only plain-typed keyword parameters."""
    hints = typing.get_type_hints(ProcessRewardModel.load)
    hints.pop("return")
    assert "path" in hints
    assert all(t in (str, int, float, bool) for t in hints.values()), hints


def test_bad_folders_raise_typed_errors(folders, tmp_path):
    with pytest.raises(ModelNotFound, match="not found"):
        ProcessRewardModel.load(str(tmp_path / "missing"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(NotAModel, match=r"config\.json"):
        ProcessRewardModel.load(str(empty))
    for arch, model_type in [("GPT2ForSequenceClassification", "gpt2"), ("BertModel", "bert"),
                             ("BertForMaskedLM", "bert")]:
        folder = tmp_path / arch
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"architectures": [arch], "model_type": model_type}))
        with pytest.raises(UnsupportedModel, match=arch) as caught:
            ProcessRewardModel.load(str(folder))
        assert "ForTokenClassification" in str(caught.value) and "ForCausalLM" in str(caught.value)
    noarch = tmp_path / "noarch"
    noarch.mkdir()
    (noarch / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    with pytest.raises(UnsupportedModel, match="architectures"):
        ProcessRewardModel.load(str(noarch))
    # a convention that contradicts the architecture
    with pytest.raises(UnsupportedModel, match=r"'tag'.*Qwen2ForTokenClassification"):
        ProcessRewardModel.load(str(folders["token2"]), convention="tag")
    with pytest.raises(UnsupportedModel, match=r"'classification'.*MistralForCausalLM"):
        ProcessRewardModel.load(str(folders["tag"]), convention="classification")
    with pytest.raises(InvalidParameter, match="convention"):
        ProcessRewardModel.load(str(folders["tag"]), convention="orm")
    # remote code refused
    with pytest.raises(UnsupportedModel, match="trust_remote_code"):
        ProcessRewardModel.load(str(folders["remote"]), trust_remote_code=False)


def test_bad_tokens_raise_typed_errors(folders, tmp_path):
    with pytest.raises(InvalidParameter, match=r"step_separator.*<extra_0>.*one token"):
        ProcessRewardModel.load(str(folders["nosep"]))
    with pytest.raises(InvalidParameter, match="step_separator"):
        ProcessRewardModel.load(str(folders["token2"]), step_separator="two plus")
    loaded = ProcessRewardModel.load(str(folders["nosep"]), step_separator="<|endoftext|>")
    assert loaded.model.marker_id == _byte_level_bpe(False)[0].token_to_id("<|endoftext|>")
    with pytest.raises(InvalidParameter, match="good_token") as caught:
        ProcessRewardModel.load(str(folders["tag"]), good_token="++")
    assert "single" in str(caught.value) and "bad_token" not in caught.value.name
    with pytest.raises(InvalidParameter, match="bad_token"):
        ProcessRewardModel.load(str(folders["tag"]), bad_token="minus")
    with pytest.raises(InvalidParameter, match="step_tag"):
        ProcessRewardModel.load(str(folders["tag"]), step_tag="two plus")
    # a token classifier with three labels is no PRM
    three = tmp_path / "three"
    from transformers import Qwen2ForTokenClassification

    Qwen2ForTokenClassification(_qwen_config(num_labels=3)).save_pretrained(three)
    _qwen_tokenizer(three)
    with pytest.raises(UnsupportedModel, match="3 labels"):
        ProcessRewardModel.load(str(three))


def test_inputs_that_would_lose_a_step_score_are_refused(folders):
    prm = ProcessRewardModel.load(str(folders["token2"]), max_length=40)
    ledger = Ledger()
    with pytest.raises(ContextWindowExceeded, match="40"):
        prm.score_steps(QUESTION, [["two plus two is four"] * 20], ledger=ledger)
    with pytest.raises(InvalidParameter, match=r"steps\[1\]"):
        prm.score_steps(QUESTION, [["two", f"plus {SEP} two"]], ledger=ledger)
    with pytest.raises(InvalidParameter, match="question"):
        prm.score_steps(f"what {SEP} is", [["two"]], ledger=ledger)
    with pytest.raises(InvalidParameter, match="partials"):
        prm.score_steps(QUESTION, ["two plus two"], ledger=ledger)
    tag = ProcessRewardModel.load(str(folders["tag"]))
    with pytest.raises(InvalidParameter, match="one 'ки' token per step"):  # a tag inside a step
        tag.score_steps(QUESTION, [["two ки plus two", "four"]], ledger=ledger)
    assert tag.score_steps(QUESTION, [[], []], ledger=ledger) == [[], []]
