"""The models and calls of `metaloom bench gpu`, and its baseline worker process.

Random-weight Llama models built from a shape name (`SHAPES`): transformers' ``LlamaForCausalLM``
made on the device, every parameter then drawn again from one seeded generator of that device
in name order (norms 1, every matrix normal with standard deviation 1/sqrt(its inputs): each
layer keeps its input's scale, so the outputs depend on the context instead of collapsing into
one repeated token, and comparing two paths' tokens means something), so two processes with the
same seed, torch and device get the same weights (`checksum` tells); metaloom's `LlamaModel` is built from its
state dict (the tensors it does not concatenate are shared, not copied) and wrapped in a
`LocalGenerator` with the tokenizer of a folder. `metaloom_call` and `transformers_call` run
one case once between two device synchronisations (`metaloom_call` optionally with speculative
decoding, `ngram_speculative`, for that call).

Run as a script (``python -P gpu_worker.py`` with ``PYTHONPATH`` naming a folder that holds
another copy of the ``metaloom`` package), this module is the baseline worker: it serves JSON
lines on stdin/stdout, measuring that copy of metaloom on the same random weights:

- ``{"op": "hello"}`` -> ``{"ok": true, "metaloom": FILE}``: which package was imported;
- ``{"op": "build", "config": HF_CONFIG, "seed": S, "device": D, "dtype": T, "tokenizer": FOLDER,
  "cases": {CASE: SPEC}}`` -> ``{"ok": true, "build_s": S, "checksum": X}`` (the previous model
  is freed first);
- ``{"op": "run", "case": CASE}`` -> ``{"ok": true, "seconds": S, "tokens": [per sequence], "digest": HEX}``;
- ``{"op": "free"}``, ``{"op": "quit"}`` -> ``{"ok": true}``.

A failure is ``{"ok": false, "error": "Type: message"}``. Whatever the libraries print goes to
stderr, never into the replies. Only the standard library is imported at module level: the
package under test is whichever ``metaloom`` the worker's path finds first.
"""

from __future__ import annotations

import gc
import hashlib
import json
import math
import os
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

GRAPHS_ENV = "METALOOM_CUDA_GRAPHS"  # auto | on | off: whether the engine captures decode steps in CUDA graphs
TRITON_ENV = "METALOOM_TRITON"  # auto | on | off: whether captured steps use the fused Triton kernels
TRITON_ROWS_ENV = "METALOOM_TRITON_ROWS"  # the most rows a Triton step runs (the PyTorch step above)

# transformers config.json fields of each shape (the vocabulary is the tokenizer's)
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "intermediate_size": 128, "tie_word_embeddings": True, "rope_theta": 10000.0},
    # SmolLM2-135M
    "135m": {"hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
             "intermediate_size": 1536, "tie_word_embeddings": True, "rope_theta": 100000.0},
    # Llama-3.2-1B's proportions
    "1b": {"hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
           "intermediate_size": 8192, "tie_word_embeddings": False, "rope_theta": 10000.0},
    # Llama-3-8B's layers with SmolLM2's vocabulary: ~7.4B parameters
    "7b": {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
           "intermediate_size": 14336, "tie_word_embeddings": False, "rope_theta": 10000.0},
}


def hf_config(shape: str, vocab_size: int) -> dict[str, Any]:
    """The transformers ``config.json`` dict of a shape (`SHAPES`) with ``vocab_size`` tokens."""
    s = SHAPES[shape]
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": vocab_size,
            "head_dim": s["hidden_size"] // s["num_attention_heads"], "max_position_embeddings": 8192,
            "rms_norm_eps": 1e-5, "attention_bias": False, "mlp_bias": False, "hidden_act": "silu",
            "rope_scaling": None, "bos_token_id": 1, "eos_token_id": 2} | s


def parameter_count(cfg: Mapping[str, Any]) -> int:
    d, i, v, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    head = cfg["head_dim"]
    per_layer = d * (cfg["num_attention_heads"] + 2 * cfg["num_key_value_heads"]) * head  # q, k, v
    per_layer += cfg["num_attention_heads"] * head * d + 3 * d * i + 2 * d  # o, gate, up, down, two norms
    return v * d * (1 if cfg["tie_word_embeddings"] else 2) + layers * per_layer + d


def step_weight_bytes(cfg: Mapping[str, Any], itemsize: int = 2) -> int:
    """Bytes of weights one batch-1 decode step reads: every linear layer and the LM head (the
    embedding table when tied); the embedding lookup (one row) and the norms left out."""
    d, i, v, head = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["head_dim"]
    per_layer = d * (2 * cfg["num_attention_heads"] + 2 * cfg["num_key_value_heads"]) * head + 3 * d * i
    return itemsize * (cfg["num_hidden_layers"] * per_layer + v * d)


def synchronize(device: Any) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def build_transformers(cfg: Mapping[str, Any], device: str, dtype: str, seed: int) -> Any:
    """transformers' Llama of ``cfg`` on ``device`` with seeded random weights (see the module
    docstring), in eval mode."""
    import torch
    import transformers

    fields = {k: v for k, v in cfg.items() if k not in ("model_type", "architectures")}
    config = transformers.LlamaConfig(**fields)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype),
                                                              attn_implementation="sdpa")
    model.to(device).eval()  # .to: a no-op where the device context already put every tensor there
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):  # tied weights appear once
            if p.dim() == 1:  # the norms (these shapes have no biases)
                p.fill_(1.0)
            else:  # [out, in]: unit gain
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[1]), generator=generator)
    return model


def checksum(model: Any) -> float:
    """A float summary of every parameter (equal weights give equal sums)."""
    import torch

    with torch.no_grad():
        return float(sum(p.double().sum().item() * (1 + k % 7) for k, (_, p) in enumerate(sorted(model.named_parameters()))))


def metaloom_generator(model: Any, cfg: Mapping[str, Any], tokenizer: str, device: str, dtype: str, name: str) -> Any:
    """A `LocalGenerator` on metaloom's `LlamaModel` built from transformers ``model``'s weights."""
    import torch

    from metaloom.generator import LocalGenerator
    from metaloom.models.engine.config import LlamaConfig
    from metaloom.models.engine.llama import LlamaModel
    from metaloom.models.engine.tokenizer import HFTokenizer
    from metaloom.models.load import LoadedModel

    config = LlamaConfig.from_hf(cfg)
    torch_dtype = getattr(torch, dtype)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    native = LlamaModel.from_state_dict(config, state, dtype=torch_dtype, device=device)
    tok = HFTokenizer(tokenizer, extra_eos_ids=config.eos_token_id)
    return LocalGenerator(LoadedModel(model=native, tokenizer=tok, name=name, folder=tokenizer, dtype=torch_dtype))


def requests(cases: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """One `Request` per case: its prompt ids, n samples of max_tokens each, end of sequence
    ignored (every sample is exactly max_tokens long), seeded when sampling."""
    from metaloom.generator import Request, TokenIds
    from metaloom.sampling import SamplingParams

    return {name: Request(TokenIds(tuple(c["prompt_ids"])),
                          SamplingParams(temperature=c["temperature"], n=c["n"], max_tokens=c["max_tokens"], ignore_eos=True,
                                         seed=c["seed"] if c["temperature"] > 0 else None))
            for name, c in cases.items()}


def digest(sequences: Sequence[Sequence[int]]) -> str:
    return hashlib.sha256(json.dumps([list(s) for s in sequences]).encode()).hexdigest()[:16]


def ngram_speculative(num_draft: int) -> Any:
    """Speculative decoding with metaloom's n-gram (prompt lookup) drafter, ``num_draft`` tokens
    a step (`metaloom.speculative.Speculative`)."""
    from metaloom.speculative import Speculative
    from metaloom.speculative.drafters.ngram import NgramDrafter

    return Speculative(NgramDrafter(), num_draft=num_draft)


def metaloom_call(gen: Any, request: Any, device: str, graphs: str | None,
                  logprobs: list[list[float]] | None = None, *, ledger: Any = None,
                  speculative: Any = None) -> tuple[float, list[list[int]]]:
    """(seconds, token ids per sample) of one ``generate``; ``graphs``: METALOOM_CUDA_GRAPHS for
    this call (None: as the environment has it; "on+torch": on, with METALOOM_TRITON=off;
    "on+mixed": on, with Triton's step at every row count, `metaloom.models.engine.static_step.PAGED_ROWS`
    choosing its attention);
    ``logprobs``: a list that receives each sample's
    token log-probabilities; ``ledger``: the `Ledger` charged (default a fresh one);
    ``speculative``: a `Speculative` the generator decodes this call with (set on it for the
    call, its own restored after; None: the generator's own, none for the benchmark's)."""
    from metaloom.ledger import Ledger

    before = {k: os.environ.get(k) for k in (GRAPHS_ENV, TRITON_ENV, TRITON_ROWS_ENV)}
    own = getattr(gen, "speculative", None)
    if graphs is not None:  # "on+torch": graphs on, Triton's kernels off
        graphs, _, kernels = graphs.partition("+")
        os.environ[GRAPHS_ENV] = graphs
        if kernels == "torch":
            os.environ[TRITON_ENV] = "off"
        elif kernels == "mixed":
            os.environ[TRITON_ROWS_ENV] = str(1 << 20)
    if speculative is not None:
        gen.speculative = speculative
    try:
        synchronize(device)
        start = time.perf_counter()
        out = gen.generate([request], ledger=Ledger() if ledger is None else ledger)
        synchronize(device)
        seconds = time.perf_counter() - start
    finally:
        if speculative is not None:
            gen.speculative = own
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    if logprobs is not None:
        logprobs += [list(c.logprobs) for c in out[0]]
    return seconds, [list(c.token_ids) for c in out[0]]


def transformers_call(model: Any, case: Mapping[str, Any], device: str, static: bool = False,
                      compile: bool = True) -> tuple[float, list[list[int]]]:
    """(seconds, token ids per sequence) of one transformers ``generate``: a DynamicCache, or with
    ``static`` a static cache (which transformers compiles on CUDA unless ``compile`` is False);
    plain temperature sampling (``top_k=0``: its default is 50), end of sequence held off by
    ``min_new_tokens``; the global seed set to the case's seed before a sampling call."""
    import torch

    ids = torch.tensor([list(case["prompt_ids"])], device=device)
    m = case["max_tokens"]
    kwargs: dict[str, Any] = {"max_new_tokens": m, "min_new_tokens": m, "num_return_sequences": case["n"],
                              "pad_token_id": 0, "attention_mask": torch.ones_like(ids)}
    if case["temperature"] > 0:
        kwargs |= {"do_sample": True, "temperature": case["temperature"], "top_k": 0, "top_p": 1.0}
        torch.manual_seed(case["seed"])
    else:
        kwargs["do_sample"] = False
    if static:
        kwargs["cache_implementation"] = "static"
        if not compile:
            kwargs["disable_compile"] = True
    synchronize(device)
    start = time.perf_counter()
    out = model.generate(ids, **kwargs)
    synchronize(device)
    seconds = time.perf_counter() - start
    return seconds, out[:, ids.shape[1]:].tolist()


def graph_counters(gen: Any) -> dict[str, int] | None:
    """The engine's CUDA-graph step counters (captures, replays, static steps, table uploads;
    `LlamaModel.step_graph_stats`), or None where the model keeps none (an older engine)."""
    stats = getattr(getattr(gen, "model", None), "step_graph_stats", None)
    if stats is None:
        return None
    return {k: v for k, v in stats().items() if isinstance(v, int)}


def graph_failures(gen: Any) -> list[str]:
    """Why the engine's captures failed, if any did (the graphs row then ran uncaptured), and
    why its Triton kernels failed ("triton: ...", the row then ran PyTorch ops)."""
    stats = getattr(getattr(gen, "model", None), "step_graph_stats", None)
    if stats is None:
        return []
    got = stats()
    return [str(f) for f in got.get("failures", [])] + [f"triton: {f}" for f in got.get("triton_failures", [])]


def free_device_memory(device: str) -> None:
    import torch

    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


class _Baseline:
    """The worker's state: one model and its requests at a time."""

    def __init__(self) -> None:
        self.gen: Any = None
        self.requests: dict[str, Any] = {}
        self.device = "cpu"

    def handle(self, msg: Mapping[str, Any]) -> dict[str, Any]:
        op = msg.get("op")
        if op == "hello":
            import metaloom

            return {"metaloom": os.path.abspath(metaloom.__file__)}
        if op == "build":
            self.free()
            start = time.perf_counter()
            self.device = msg["device"]
            model = build_transformers(msg["config"], self.device, msg["dtype"], msg["seed"])
            total = checksum(model)
            self.gen = metaloom_generator(model, msg["config"], msg["tokenizer"], self.device, msg["dtype"], "baseline")
            del model  # the native model keeps the tensors it uses
            self.requests = requests(msg["cases"])
            free_device_memory(self.device)
            return {"build_s": time.perf_counter() - start, "checksum": total}
        if op == "run":
            seconds, seqs = metaloom_call(self.gen, self.requests[msg["case"]], self.device, None)
            return {"seconds": seconds, "tokens": [len(s) for s in seqs], "digest": digest(seqs),
                    "ids": seqs[0] if len(seqs) == 1 else None}
        if op == "free":
            self.free()
            return {}
        raise ValueError(f"unknown op {op!r}")

    def free(self) -> None:
        if self.gen is not None:
            self.gen, self.requests = None, {}
            free_device_memory(self.device)


def main() -> None:
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever the libraries print goes to stderr, not into the protocol
    sys.stdout = sys.stderr
    state = _Baseline()
    for line in sys.stdin:
        if not line.strip():
            continue
        msg = json.loads(line)
        if msg.get("op") == "quit":
            replies.write(json.dumps({"ok": True}) + "\n")
            break
        try:
            reply = {"ok": True} | state.handle(msg)
        except Exception as exc:  # reported to the driver, which records it on the row
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        replies.write(json.dumps(reply) + "\n")


if __name__ == "__main__":
    main()
