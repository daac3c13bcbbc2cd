"""Models users bring, through the CLI: a GGUF no backend reads, a truncated or corrupted GGUF,
a config with a RoPE scaling neither backend knows, all one clear error line and exit status 2;
``--backend auto`` says in ``--json`` which backend ran; a chat template variable reaches the
template."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

METALOOM = os.path.join(os.path.dirname(sys.executable), "metaloom")


def run(*args, cache=None, timeout=300):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    if cache is not None:
        env["METALOOM_CACHE"] = str(cache)
    return subprocess.run([METALOOM, *args], capture_output=True, text=True, timeout=timeout, env=env)


def _one_line_error(out):
    assert out.returncode == 2, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr
    assert "Traceback" not in out.stderr
    return lines[0]


def _gguf(path, arch, tensors=True):
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    if tensors:
        w.add_tensor("token_embd.weight", np.ones((64, 32), dtype=np.float32))
        w.add_tensor("blk.0.attn_norm.weight", np.ones(32, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_a_gguf_no_backend_reads_names_its_architecture_and_both_lists(tmp_path):
    path = _gguf(tmp_path / "odd.gguf", "nonesuch")
    line = _one_line_error(run("generate", "hi", "--model", str(path), cache=tmp_path / "cache"))
    assert "'nonesuch'" in line and "neither backend" in line
    assert "native: [" in line and "'gemma3'" in line and "'qwen3'" in line  # the native list
    assert "transformers 5." in line and "'falcon'" in line  # transformers' list


def test_a_truncated_gguf_is_one_line(tmp_path):
    path = _gguf(tmp_path / "cut.gguf", "llama")
    data = path.read_bytes()
    path.write_bytes(data[:len(data) - 4096])  # the tensor data cut short
    line = _one_line_error(run("generate", "hi", "--model", str(path), cache=tmp_path / "cache"))
    assert "cut.gguf" in line and "GGUF" in line


def test_a_corrupted_gguf_is_one_line(tmp_path):
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"GGUF" + bytes(range(256)) * 8)
    line = _one_line_error(run("generate", "hi", "--model", str(path), cache=tmp_path / "cache"))
    assert "junk.gguf" in line and "GGUF" in line


def _folder(tmp_path, **config):
    folder = tmp_path / "model"
    folder.mkdir()
    cfg = {"model_type": "llama", "vocab_size": 32, "hidden_size": 32, "intermediate_size": 64,
           "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2} | config
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


@pytest.mark.parametrize("backend", ["auto", "native", "transformers"])
def test_an_unknown_rope_scaling_names_it_and_what_is_supported(tmp_path, backend):
    folder = _folder(tmp_path, rope_scaling={"rope_type": "spiral", "factor": 2.0})
    line = _one_line_error(run("generate", "hi", "--model", str(folder), "--backend", backend))
    assert "'spiral'" in line and "llama3" in line and "longrope" in line
    if backend != "native":
        assert "yarn" in line  # transformers' list too


def test_auto_reports_the_backend_that_ran(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    from tests.test_hf_adapter import VOCAB, _write_tokenizer

    # a GPT-2 folder: the native engine does not run it, so auto takes transformers and says so
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=1, n_head=2)).eval()
    folder = tmp_path / "gpt2"
    model.save_pretrained(folder)
    _write_tokenizer(folder)
    out = run("generate", "hi", "--model", str(folder), "--raw", "--max-tokens", "2", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["usage"]["backend"] == "transformers"
    out = run("generate", "hi", "--raw", "--max-tokens", "2", "--json")  # the default model: native
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["usage"]["backend"] == "native"


def test_a_bad_chat_template_arg_is_one_line():
    line = _one_line_error(run("generate", "hi", "--chat-template-arg", "enable_thinking"))
    assert "chat-template-arg" in line and "KEY=VALUE" in line
