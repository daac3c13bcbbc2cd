"""One system of `metaloom bench decode` in its own process: ``PYTHON worker.py``, where PYTHON
is the interpreter of the system's own virtual environment (llama.cpp's and vLLM's venvs do not
have metaloom installed, so this file imports only the standard library at module level and
each system's own packages inside it).

The protocol is JSON lines over stdin/stdout, one reply per request:

- ``{"op": "load", "system": NAME, "config": {...}, "cases": {CASE: SPEC}, "threads": T}``
  -> ``{"ok": true, "info": {...}}``: build the system once (not timed);
- ``{"op": "run", "case": CASE}`` -> ``{"ok": true, "seconds": S, "tokens": N}``: reset what
  the system keeps between calls (prefix caches, KV), then generate the case once; ``S`` is the
  wall time of the generation alone, ``N`` the tokens generated over all sequences;
- ``{"op": "quit"}`` -> ``{"ok": true}``, then exit.

A failure is ``{"ok": false, "error": "Type: message"}``; a crash is the process ending. A case
SPEC is ``{"prompt_ids": [...], "n": sequences, "max_tokens": per sequence, "temperature": t,
"seed": s}``; every system ignores end-of-sequence so it generates exactly ``n * max_tokens``.
Libraries that print to stdout cannot corrupt the protocol: fd 1 is pointed at stderr and the
replies go to a private copy of the original stdout.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, TextIO

Case = dict[str, Any]


class FakeSystem:
    """For the tests: sleeps ``config["seconds"][case]`` and reports ``n * max_tokens`` tokens
    (or ``config["tokens"][case]``); appends ``"LABEL CASE"`` to ``config["log"]`` per run; exits
    with status 3 on run number ``config["crash_on_run"]`` (1-based); ``config["fail_load"]``
    makes loading fail with that message, ``config["crash_on_load"]`` makes it crash; with
    ``config["pid_dir"]`` it leaves its pid there and logs the others' process states per run."""

    def __init__(self, config: dict[str, Any], cases: dict[str, Case], threads: int) -> None:
        if config.get("crash_on_load"):
            os._exit(4)
        if config.get("fail_load"):
            raise RuntimeError(config["fail_load"])
        self.config, self.cases, self.runs = config, cases, 0
        self.label = config.get("label", "fake")
        self.info = {"threads": threads, "label": self.label}
        if pid_dir := config.get("pid_dir"):
            with open(os.path.join(pid_dir, self.label), "w") as f:
                f.write(str(os.getpid()))

    def prepare(self, case: str) -> None:
        pass

    def run(self, case: str) -> int:
        self.runs += 1
        if self.runs == self.config.get("crash_on_run"):
            os._exit(3)
        if log := self.config.get("log"):
            line = f"{self.label} {case}"
            if pid_dir := self.config.get("pid_dir"):
                for other in sorted(set(os.listdir(pid_dir)) - {self.label}):
                    with open(os.path.join(pid_dir, other)) as f, open(f"/proc/{f.read()}/stat") as stat:
                        line += f" {other}:{stat.read().rsplit(')', 1)[1].split()[0]}"  # R, S, T (stopped) ...
            with open(log, "a") as f:
                f.write(line + "\n")
        time.sleep(self.config.get("seconds", {}).get(case, 0.0))
        spec = self.cases[case]
        return int(self.config.get("tokens", {}).get(case, spec["n"] * spec["max_tokens"]))


class MetaloomSystem:
    """metaloom's `LocalGenerator`: ``config`` has model, dtype, device and weights ("native"
    runs the GGUF's quantised blocks, "dense" dequantises to dtype), and may have activations
    ("q8": native weights times int8 activations)."""

    def __init__(self, config: dict[str, Any], cases: dict[str, Case], threads: int) -> None:
        import inspect

        import torch

        from metaloom.generator import LocalGenerator, Request, TokenIds
        from metaloom.models import load
        from metaloom.models.kernels.fused import step_path
        from metaloom.sampling import SamplingParams

        torch.set_num_threads(threads)
        kwargs: dict[str, Any] = {"dtype": config["dtype"], "device": config.get("device")}
        weights = config.get("weights", "dense")
        if "weights" in inspect.signature(load).parameters:
            kwargs["weights"] = weights  # explicit: load's default picks whichever is faster here
        elif weights != "dense":
            raise RuntimeError(f"this metaloom's load() has no weights= parameter: weights={weights!r} is not available")
        activations = config.get("activations", "float")
        if activations != "float":
            if "activations" not in inspect.signature(load).parameters:
                raise RuntimeError(f"this metaloom's load() has no activations= parameter: {activations!r} is not available")
            kwargs["activations"] = activations
        loaded = load(config["model"], **kwargs)
        if getattr(loaded, "weights", "dense") != weights:  # the row's label must say what ran
            raise RuntimeError(f"asked for weights={weights!r}, load() gave {getattr(loaded, 'weights', 'dense')!r}")
        if getattr(loaded, "activations", "float") != activations:
            raise RuntimeError(f"asked for activations={activations!r}, load() gave {getattr(loaded, 'activations', 'float')!r}")
        self.gen = LocalGenerator(loaded)
        self.requests = {
            name: Request(TokenIds(tuple(c["prompt_ids"])),
                          SamplingParams(temperature=c["temperature"], n=c["n"], max_tokens=c["max_tokens"], ignore_eos=True,
                                         seed=c.get("seed") if c["temperature"] > 0 else None))
            for name, c in cases.items()}
        model: Any = loaded.model
        self.info = {"step_path": step_path(model), "device": str(getattr(model, "device", "cpu")), "weights": weights,
                     "activations": activations,
                     "isa": _kernel_path(),
                     "dense_weight_bytes": int(model.num_parameters() * loaded.dtype.itemsize)
                     if hasattr(model, "num_parameters") else None}

    def prepare(self, case: str) -> None:
        pass  # LocalGenerator keeps no cache between calls unless given a prefix cache

    def run(self, case: str) -> int:
        from metaloom.ledger import Ledger

        out = self.gen.generate([self.requests[case]], ledger=Ledger())
        return sum(len(c.token_ids) for c in out[0])


class TransformersSystem:
    """transformers ``generate`` on the converted folder (``config``: folder, dtype, device);
    plain temperature sampling (``top_k=0``: its default is 50), EOS held off by min_new_tokens."""

    def __init__(self, config: dict[str, Any], cases: dict[str, Case], threads: int) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(threads)
        self.torch = torch
        device = torch.device(config.get("device") or "cpu")
        model = AutoModelForCausalLM.from_pretrained(config["folder"], dtype=getattr(torch, config["dtype"]))
        self.model = model.to(device).eval()  # type: ignore[arg-type]  # transformers' stubs type .to() narrowly
        self.cases = cases
        self.ids = {name: torch.tensor([c["prompt_ids"]], device=device) for name, c in cases.items()}
        self.info = {"device": str(device), "transformers": __import__("transformers").__version__}

    def prepare(self, case: str) -> None:
        if (seed := self.cases[case].get("seed")) is not None:
            self.torch.manual_seed(seed)

    def run(self, case: str) -> int:
        c, ids = self.cases[case], self.ids[case]
        m = c["max_tokens"]
        sampling: dict[str, Any] = ({"do_sample": True, "temperature": c["temperature"], "top_k": 0, "top_p": 1.0}
                                    if c["temperature"] > 0 else {"do_sample": False})
        with self.torch.inference_mode():
            out = self.model.generate(ids, attention_mask=self.torch.ones_like(ids), max_new_tokens=m, min_new_tokens=m,
                                      num_return_sequences=c["n"], pad_token_id=0, **sampling)
        if out.device.type == "cuda":
            self.torch.cuda.synchronize(out.device)
        return int(out.shape[0] * (out.shape[1] - ids.shape[1]))


class LlamaCppSystem:
    """llama-cpp-python's low-level API on the GGUF file (``config``: gguf, extra_buffers). One
    context per case with ``n_seq_max = n`` and a unified KV cache: the prompt is decoded once
    with every token belonging to all n sequences (shared, as llama.cpp's ``batched`` example
    does), then each step decodes one token per sequence in one batch; each sequence has its
    own sampler (greedy, or temperature then ``dist`` seeded seed + i)."""

    def __init__(self, config: dict[str, Any], cases: dict[str, Case], threads: int) -> None:
        import llama_cpp as C

        self.C = C
        C.llama_backend_init()
        mp = C.llama_model_default_params()
        mp.n_gpu_layers = 0
        mp.use_extra_bufts = bool(config.get("extra_buffers", False))  # AMX/repacked kernels crash on some CPUs
        self.model = C.llama_model_load_from_file(config["gguf"].encode(), mp)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {config['gguf']}")
        self.cases = cases
        self.ctx: dict[str, Any] = {}
        self.batch: dict[str, Any] = {}
        for name, c in cases.items():
            prompt, n = len(c["prompt_ids"]), c["n"]
            cp = C.llama_context_default_params()
            cp.n_ctx = (prompt + n * c["max_tokens"] + 64 + 255) // 256 * 256
            cp.n_batch = cp.n_ubatch = max(prompt, n)
            cp.n_seq_max = n
            cp.n_threads = cp.n_threads_batch = threads
            cp.kv_unified = True  # the prompt's cells are shared by all n sequences
            cp.no_perf = True
            ctx = C.llama_init_from_model(self.model, cp)
            if not ctx:
                raise RuntimeError(f"llama.cpp could not create a context for case {name!r}")
            self.ctx[name] = ctx
            self.batch[name] = C.llama_batch_init(max(prompt, n), 0, n)
        self.samplers: list[Any] = []
        for name, c in cases.items():  # exercise every batch shape now: a crashing kernel shows at load
            self.prepare(name)
            self._generate(name, min(2, c["max_tokens"]))
        self.info = {"llama_cpp_python": C.__version__, "extra_buffers": mp.use_extra_bufts, "n_threads": threads}

    def prepare(self, case: str) -> None:
        C, c = self.C, self.cases[case]
        for s in self.samplers:
            C.llama_sampler_free(s)
        self.samplers = []
        for i in range(c["n"]):
            chain = C.llama_sampler_chain_init(C.llama_sampler_chain_default_params())
            if c["temperature"] > 0:
                C.llama_sampler_chain_add(chain, C.llama_sampler_init_temp(float(c["temperature"])))
                C.llama_sampler_chain_add(chain, C.llama_sampler_init_dist(int(c.get("seed") or 0) + i))
            else:
                C.llama_sampler_chain_add(chain, C.llama_sampler_init_greedy())
            self.samplers.append(chain)
        C.llama_memory_clear(C.llama_get_memory(self.ctx[case]), True)  # no reuse of the previous call's prompt

    def run(self, case: str) -> int:
        return self._generate(case, self.cases[case]["max_tokens"])

    def _generate(self, case: str, m: int) -> int:
        C, c, ctx, batch = self.C, self.cases[case], self.ctx[case], self.batch[case]
        ids, n = c["prompt_ids"], c["n"]
        for j, t in enumerate(ids):
            batch.token[j], batch.pos[j], batch.n_seq_id[j], batch.logits[j] = t, j, n, 0
            for s in range(n):
                batch.seq_id[j][s] = s
        batch.logits[len(ids) - 1] = 1
        batch.n_tokens = len(ids)
        self._decode(ctx, batch)
        rows = [len(ids) - 1] * n  # where each sequence's logits are in the last batch
        produced = 0
        for step in range(m):
            tokens = [C.llama_sampler_sample(self.samplers[s], ctx, rows[s]) for s in range(n)]
            produced += n
            if step == m - 1:
                break
            for s, t in enumerate(tokens):
                batch.token[s], batch.pos[s], batch.n_seq_id[s], batch.logits[s] = t, len(ids) + step, 1, 1
                batch.seq_id[s][0] = s
            batch.n_tokens = n
            rows = list(range(n))
            self._decode(ctx, batch)
        return produced

    def _decode(self, ctx: Any, batch: Any) -> None:
        if (status := self.C.llama_decode(ctx, batch)) != 0:
            raise RuntimeError(f"llama_decode returned {status}")


class VllmSystem:
    """vLLM's offline ``LLM`` in this process (``config``: folder, dtype); token-id prompts,
    ``n`` samples per request, EOS ignored, prefix cache reset before every call (on by default:
    a repeat would skip its prefill)."""

    def __init__(self, config: dict[str, Any], cases: dict[str, Case], threads: int) -> None:
        import vllm
        from vllm import LLM, SamplingParams

        self.llm = LLM(model=config["folder"], dtype=config["dtype"], enforce_eager=True, max_model_len=2048, seed=0)
        self.prompts = {name: {"prompt_token_ids": list(c["prompt_ids"])} for name, c in cases.items()}
        self.params = {name: SamplingParams(n=c["n"], temperature=c["temperature"], top_p=1.0, top_k=0, min_p=0.0,
                                            max_tokens=c["max_tokens"], min_tokens=c["max_tokens"], ignore_eos=True)
                       for name, c in cases.items()}
        self.info = {"vllm": vllm.__version__, "omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND")}

    def prepare(self, case: str) -> None:
        self.llm.reset_prefix_cache()

    def run(self, case: str) -> int:
        out = self.llm.generate([self.prompts[case]], self.params[case], use_tqdm=False)
        return sum(len(o.token_ids) for o in out[0].outputs)


def _kernel_path() -> str | None:
    """The instruction-set path metaloom's C kernels run in this process (None: an older metaloom)."""
    try:
        from metaloom.models.kernels.quant_library import kernels
    except ImportError:
        return None
    k = kernels().kernels
    return getattr(k, "isa", None) or (None if k is not None else "none: " + kernels().reason)


SYSTEMS: dict[str, Any] = {"fake": FakeSystem, "metaloom": MetaloomSystem, "transformers": TransformersSystem,
                           "llama.cpp": LlamaCppSystem, "vllm": VllmSystem}


def serve(requests: TextIO, replies: TextIO) -> None:
    """Answer requests until ``quit`` or end of input."""
    system: Any = None
    for line in requests:
        if not line.strip():
            continue
        reply: dict[str, Any] = {"ok": True}
        op = None
        try:
            msg = json.loads(line)
            op = msg.get("op")
            if op == "load":
                system = SYSTEMS[msg["system"]](msg.get("config", {}), msg["cases"], int(msg.get("threads", 1)))
                reply["info"] = system.info
            elif op == "run":
                if system is None:
                    raise RuntimeError("run before load")
                system.prepare(msg["case"])
                start = time.perf_counter()
                tokens = system.run(msg["case"])
                reply.update(seconds=time.perf_counter() - start, tokens=tokens)
            elif op != "quit":
                raise ValueError(f"unknown op {op!r} (load, run, quit)")
        except Exception as exc:  # any failure of the system is the parent's to report, not ours to die of
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()
        if op == "quit":
            return


def main() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    # run as a script, our folder is sys.path[0]: its modules (serve, search, ...) must not shadow packages
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever the libraries print goes to stderr, not into the protocol
    sys.stdout = sys.stderr
    serve(sys.stdin, replies)


if __name__ == "__main__":
    main()
