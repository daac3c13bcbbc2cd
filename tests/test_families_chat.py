"""Chat templates from the model: its own template with variables passed through (Qwen3's
``enable_thinking``), its own stop tokens (``generation_config.json``), and a model without a
template running raw after one warning."""

import json
import logging

import pytest

from metaloom.models.engine.tokenizer import HFTokenizer

# the part of Qwen3's template that thinking mode touches: an empty think block when it is off
QWEN3_LIKE = (r"{%- for m in messages %}{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{%- endfor %}"
              r"{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
              r"{%- if enable_thinking is defined and enable_thinking is false %}{{ '<think>\n\n</think>\n\n' }}"
              r"{%- endif %}{%- endif %}")


def _folder(tmp_path, template=None, generation_eos=None):
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>", "<s>", "</s>", "<end_of_turn>", "hello", "world"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    from tokenizers import processors

    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.add_special_tokens(["<s>", "</s>", "<end_of_turn>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    cfg = {"bos_token": "<s>", "eos_token": "</s>"} | ({"chat_template": template} if template else {})
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    if generation_eos is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": generation_eos}))
    return tmp_path


def test_template_variables_reach_the_models_template(tmp_path):
    folder = _folder(tmp_path, QWEN3_LIKE)
    messages = [{"role": "user", "content": "hello"}]
    thinking = HFTokenizer(str(folder)).apply_chat_template(messages)
    assert thinking.endswith("<|im_start|>assistant\n")  # budget forcing appends its "<think>\n" here
    off = HFTokenizer(str(folder), template_args={"enable_thinking": False}).apply_chat_template(messages)
    assert off == thinking + "<think>\n\n</think>\n\n"


def test_a_model_without_a_template_warns_once_and_runs_raw(tmp_path, caplog):
    tok = HFTokenizer(str(_folder(tmp_path)))
    with caplog.at_level(logging.WARNING):
        first = tok.apply_chat_template([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}])
        second = tok.apply_chat_template([{"role": "user", "content": "world"}])
    assert [r.getMessage() for r in caplog.records if "no chat template" in r.getMessage()] != []
    assert sum("no chat template" in r.getMessage() for r in caplog.records) == 1
    # the raw text, with the BOS the tokenizer gives plain text (chat prompts are encoded without)
    assert first == "<s>be brief\n\nhello" and second == "<s>world"
    assert tok.encode(second, add_special_tokens=False) == tok.encode("world")


def test_the_models_own_stop_tokens(tmp_path):
    import torch

    from metaloom.models import load
    from metaloom.models.engine.config import LlamaConfig
    from metaloom.testing.tiny import random_weights

    folder = _folder(tmp_path, QWEN3_LIKE, generation_eos=[2, 3])
    config = {"model_type": "qwen3", "vocab_size": 6, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
              "eos_token_id": 2, "max_position_embeddings": 64}
    (folder / "config.json").write_text(json.dumps(config))
    from safetensors.torch import save_file

    sd = random_weights(LlamaConfig.from_hf(config))
    for i in range(1):
        for n in "qk":
            sd[f"model.layers.{i}.self_attn.{n}_norm.weight"] = torch.ones(32)
    save_file(sd, str(folder / "model.safetensors"))
    loaded = load(str(folder), chat_template_args={"enable_thinking": False})
    assert loaded.backend == "native" and loaded.model.config.qk_norm
    assert loaded.tokenizer.eos_token_ids == {2, 3}  # <end_of_turn> from generation_config.json
    assert loaded.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]).endswith("</think>\n\n")


@pytest.mark.parametrize("item", ["enable_thinking", "=1", "a b=1"])
def test_a_chat_template_arg_needs_key_and_value(item):
    from metaloom.commands.common import chat_template_args
    from metaloom.errors import InvalidParameter

    with pytest.raises(InvalidParameter, match="chat-template-arg"):
        chat_template_args([item])
    assert chat_template_args(["enable_thinking=false", "name=x y"]) == {"enable_thinking": False, "name": "x y"}
