"""The peers `metaloom bench speculative` runs beside metaloom (``--peers``): transformers
``generate`` (plain, with ``prompt_lookup_num_tokens``, and with ``assistant_model`` when
``--draft-model`` is given) and llama.cpp through ``llama-cpp-python`` (plain and with its
prompt-lookup draft) on the GGUF file. llama.cpp runs the GGUF's own quantised weights, so its
tokens differ: compare rates. A llama.cpp build that crashes is found in a child process first
(`_llama_cpp_probe`) and skipped, not allowed to take the benchmark down."""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

from metaloom.bench.speculative.methods import Method
from metaloom.bench.speculative.prompts import PROMPT_SETS
from metaloom.errors import InvalidParameter
from metaloom.models import LoadedModel, load
from metaloom.speculative.registry import DRAFTERS


def transformers_methods(args: argparse.Namespace, loaded: LoadedModel, n: int, skipped: dict[str, str]) -> list[Method]:
    from transformers import AutoModelForCausalLM

    tok = loaded.tokenizer
    hf = AutoModelForCausalLM.from_pretrained(loaded.folder, dtype=loaded.dtype).eval()
    eos = sorted(tok.eos_token_ids)
    ids = [torch.tensor([tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]), add_special_tokens=False)])
           for p in PROMPT_SETS[args.prompts]]

    def method(name: str, **extra: Any) -> Method:
        def run(i: int) -> tuple[list[int], None]:
            with torch.inference_mode():
                out = hf.generate(ids[i], attention_mask=torch.ones_like(ids[i]), max_new_tokens=n, do_sample=False,
                                  eos_token_id=eos, pad_token_id=eos[0] if eos else 0, **extra)
            return out[0, ids[i].shape[1]:].tolist(), None

        return Method(name, run, peer=True)

    k = args.num_draft or DRAFTERS["ngram"].num_draft
    out = [method("transformers greedy"), method(f"transformers prompt lookup (K={k})", prompt_lookup_num_tokens=k)]
    if args.draft_model:
        draft = load(args.draft_model, dtype=str(loaded.dtype).removeprefix("torch."))
        assistant = AutoModelForCausalLM.from_pretrained(draft.folder, dtype=loaded.dtype).eval()
        out.append(method("transformers assisted (draft model)", assistant_model=assistant))
    else:
        skipped["transformers assisted (draft model)"] = "no --draft-model given"
    return out


def _gguf_path(spec: str) -> str | None:
    if spec in ("", "default"):
        from metaloom.models.find import default_model_path

        return default_model_path()
    return spec if spec.endswith(".gguf") and os.path.exists(spec) else None


def llama_cpp_methods(args: argparse.Namespace, loaded: LoadedModel, n: int, skipped: dict[str, str]) -> list[Method]:
    try:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    except ImportError:
        skipped["llama.cpp"] = "llama-cpp-python is not installed (pip install llama-cpp-python)"
        return []
    path = _gguf_path(args.model)
    if path is None:
        skipped["llama.cpp"] = "the model is not a GGUF file"
        return []
    extra_buffers = True
    problem = _llama_cpp_probe(path, extra_buffers=True)
    if problem is not None and _llama_cpp_probe(path, extra_buffers=False) is None:
        extra_buffers = False  # the default crashed (AMX kernels here); the plain kernels work
        skipped["llama.cpp extra buffer types (AMX, repacked weights)"] = problem
    elif problem is not None:
        skipped["llama.cpp"] = problem
        return []
    tok = loaded.tokenizer
    ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]), add_special_tokens=False)
           for p in PROMPT_SETS[args.prompts]]
    threads = torch.get_num_threads()
    k = args.num_draft or DRAFTERS["ngram"].num_draft

    def method(name: str, **extra: Any) -> Method:
        with llama_cpp_params(extra_buffers):
            llm = Llama(model_path=path, n_ctx=2048, n_threads=threads, n_threads_batch=threads, verbose=False, **extra)

        def run(i: int) -> tuple[list[int], None]:
            llm.reset()  # no prompt reuse across calls: every call prefills, as the other methods do
            tokens: list[int] = []
            for token in llm.generate(ids[i], top_k=1, temp=0.0, reset=True):
                if token in tok.eos_token_ids or len(tokens) == n:
                    break
                tokens.append(token)
            return tokens, None

        return Method(name, run, peer=True)

    return [method("llama.cpp greedy"),
            method(f"llama.cpp prompt lookup (K={k})", draft_model=LlamaPromptLookupDecoding(num_pred_tokens=k))]


_PROBE = """
import sys
from llama_cpp import Llama
from metaloom.bench.speculative.peers import llama_cpp_params
with llama_cpp_params(extra_buffers=sys.argv[2] == "on"):
    llm = Llama(model_path=sys.argv[1], n_ctx=64, n_threads=1, verbose=False)
llm.create_completion([1, 2, 3], max_tokens=2, temperature=0.0)
"""


def _llama_cpp_probe(path: str, extra_buffers: bool) -> str | None:
    """Decode two tokens in a child process: a llama.cpp build that crashes (e.g. its AMX
    kernels, which segfault on this project's machine) must not take the benchmark down."""
    try:
        done = subprocess.run([sys.executable, "-c", _PROBE, path, "on" if extra_buffers else "off"],
                              capture_output=True, timeout=300)
    except subprocess.TimeoutExpired:
        return "llama-cpp-python did not decode two tokens in 300 s"
    if done.returncode != 0:
        tail = done.stderr.decode(errors="replace").strip().splitlines()[-1:] or [""]
        return f"llama-cpp-python is installed but fails on this machine (exit {done.returncode}) {tail[0]}".strip()
    return None


@contextlib.contextmanager
def llama_cpp_params(extra_buffers: bool) -> Iterator[None]:
    """Load llama.cpp models inside this block with or without its extra buffer types (AMX /
    repacked weights; without: the plain AVX2/AVX-512 kernels). llama-cpp-python has no
    argument for ``use_extra_bufts``, so its default model parameters are wrapped meanwhile."""
    if extra_buffers:
        yield
        return
    import llama_cpp.llama_cpp as C

    default = C.llama_model_default_params

    def params() -> Any:
        p = default()
        p.use_extra_bufts = False
        return p

    C.llama_model_default_params = params
    try:
        yield
    finally:
        C.llama_model_default_params = default


PEERS: dict[str, Callable[[argparse.Namespace, LoadedModel, int, dict[str, str]], list[Method]]] = {
    "transformers": transformers_methods, "llama.cpp": llama_cpp_methods}


def check_peers(args: argparse.Namespace) -> set[str]:
    """The ``--peers`` asked for; an unknown one is an `InvalidParameter`."""
    peers = {p for p in args.peers.split(",") if p}
    if unknown := peers - set(PEERS):
        raise InvalidParameter("peers", sorted(unknown), f"a comma-separated subset of {list(PEERS)}")
    return peers
