"""`metaloom bench gpu`: the local engine on a GPU against transformers, on random-weight Llama
models built on the device (issue 35: decoding at the memory-bandwidth limit).

Shapes (`metaloom.bench.gpu_worker.SHAPES`, bfloat16 by default, the tokenizer's vocabulary):
``135m`` (SmolLM2-135M), ``1b`` (Llama-3.2-1B's proportions), ``7b`` (Llama-3-8B's layers,
~7.4B parameters with SmolLM2's 49,152 tokens), ``tiny`` (for tests on the CPU). Each shape's
weights are drawn once on the device from a seeded generator; transformers and metaloom run
the same tensors; each shape is freed before the next. ``--shapes 1b,7b:greedy+s16,135m`` runs
shapes in that order, each with the cases named after its colon (default ``--cases``).

Cases, the same prompt token ids for every system, end of sequence ignored so every sample is
exactly as long as asked (another count is an error on the row): ``greedy`` batch-1 greedy, 128
tokens from the chat-templated prompt of `metaloom bench decode`; ``s16`` 16 samples x 64
tokens from its ~350-token prompt at temperature 1, seeded; ``s64`` 64 samples x 128 tokens
from the same prompt (the issue's target); ``spec`` (only when named: not in the default
``--cases``) batch-1 greedy, 128 tokens, with speculative decoding: metaloom's n-gram drafter
(prompt lookup) proposes ``--spec-draft`` K tokens a step and the target verifies the pending
token and the drafts in one forward (the static, CUDA-graph-captured step where graphs are on),
on a chat-templated prompt asking to copy a passage it holds (`COPY_PROMPT`: input-grounded, so
drafts can be accepted; with random weights acceptance is whatever it is, and the rows report
it). ``--max-tokens`` caps the lengths (tests).

Systems (rows): ``graphs`` / ``eager``: one `LocalGenerator` with METALOOM_CUDA_GRAPHS ``on`` /
``off`` around each call (the engine reads it at each step); ``graphs-torch``: graphs on with
METALOOM_TRITON=off (the captured step in PyTorch ops, without the fused Triton kernels that
``graphs`` uses where Triton runs, `metaloom.models.kernels.gpu_triton`); ``graphs-mixed``: graphs
on with Triton's step above `graphs.TRITON_ROWS` rows too, attention there by gather + SDPA
(METALOOM_TRITON_ROWS; only when named: not in the default ``--systems``; the same as ``graphs``
while `graphs.TRITON_ROWS` is every bucket); ``tf-eager``: transformers
``generate`` with its DynamicCache; ``tf-static``: ``generate`` with a static cache, which
transformers compiles on CUDA (torch.compile, CUDA graphs): its warm-up (two calls) holds the
compilation, reported apart, and it is timed after the other rows of its case (not alternated
with them: a compilation that runs long cannot cost them their rounds); a compilation that
fails is the row's note and the row is measured without it; one that would not fit the time
left (``--compile-s``, an estimate, and at most ``--compile-share`` of the budget for all
compilations) is skipped with that reason;
``baseline``: the ``metaloom`` package in ``--baseline-path DIR`` (an older copy) measured in a
worker process (`metaloom.bench.gpu_worker`) on the same weights (same seed; the checksum is
compared), for ``--baseline-cases`` only. The ``spec`` case runs metaloom's rows only: ``graphs``
and ``eager`` (of ``--systems``) speculating, and as the reference the same request without
speculation, graphs on ("metaloom graphs, no speculation"; graphs off where ``--systems`` has no
graphs). Its rows also report their call's ledger: forward passes (the prefill included),
tokens and milliseconds per forward, and speculating, drafted / accepted tokens, verify steps,
accepted drafts per verify step (0 .. K) and the acceptance rate; the report's ratios give
speculation's speed-up (tok/s with over without). Rows with graphs on keep the engine's graph
counters (captures, replays, static steps); on CUDA a row without replays says so in its note.

Timing: device synchronised around each call; per (shape, case) one warm-up call per system,
then ``--repeats`` rounds alternating the systems; median and min-max tokens/s (all sequences'
tokens over the call's seconds; the prompt's prefill included), and per step the median
seconds over tokens per sequence. The device's copy bandwidth (a large device-to-device copy,
bytes read + written, median of 10) is measured once; for batch-1 greedy rows, the weights one
step reads (every linear layer and the LM head, embedding lookup excluded) over the median step
time, and ``bandwidth_fraction``: that over the copy bandwidth (not for speculating rows, whose
steps emit several tokens). Each row says whether its token ids equal metaloom eager's (greedy:
the first position that differs; in the ``spec`` case eager is speculating too, so the reference
row's comparison is speculation's exactness; in bfloat16 two correct paths may part at a near
tie: reported).

Time guard: ``--budget-s`` for the whole run; before each shape and each (shape, case, system)
cell the cost is estimated (a prior from the shape and the copy bandwidth, scaled by what was
measured so far) and what does not fit is skipped with reason "time budget"; rounds stop early
when the next would not fit. ``--out`` is rewritten after every cell, so a run cut short keeps
what it measured. ``--smoke``: instead of timing, compare metaloom's token ids with
METALOOM_CUDA_GRAPHS on and off (greedy, and 4 seeded samples); exit status 1 when they differ.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

from metaloom.bench import gpu_worker as gw
from metaloom.bench import names
from metaloom.errors import InvalidParameter

HELP = "the local engine on a GPU against transformers: random-weight Llama shapes, tokens/s and bandwidth"


@dataclass(frozen=True)
class CaseShape:
    label: str
    n: int
    max_tokens: int
    prompt: str  # "chat" (the short chat-templated prompt), "long" or "copy" (chat-templated: copy a passage)
    temperature: float
    speculative: bool = False  # decoded with n-gram speculative decoding (--spec-draft tokens a step)


CASES: dict[str, CaseShape] = {
    "greedy": CaseShape("batch-1 greedy", 1, 128, "chat", 0.0),
    "s16": CaseShape("16 samples", 16, 64, "long", 1.0),
    "s64": CaseShape("64 samples", 64, 128, "long", 1.0),
    "spec": CaseShape("batch-1 greedy, n-gram speculative decoding", 1, 128, "copy", 0.0, speculative=True),
}
DEFAULT_CASES = ("greedy", "s16", "s64")  # spec only when named
SMOKE_CASES: dict[str, CaseShape] = {
    "greedy": CASES["greedy"],
    "s4": CaseShape("4 seeded samples", 4, 64, "long", 1.0),
}
SYSTEMS: dict[str, str] = {"graphs": "metaloom graphs", "graphs-torch": "metaloom graphs, PyTorch ops",
                           "graphs-mixed": "metaloom graphs, Triton step at every row count",
                           "eager": "metaloom eager", "baseline": "metaloom baseline",
                           "tf-eager": "transformers eager", "tf-static": "transformers static"}
DEFAULT_SYSTEMS = "graphs,graphs-torch,eager,baseline,tf-eager,tf-static"
# the speculative case's reference rows: the same engine decoding the same request without speculation
NO_SPECULATION = {"graphs": "graphs-nospec", "eager": "eager-nospec"}
ROW_NAMES: dict[str, str] = SYSTEMS | {"graphs-nospec": "metaloom graphs, no speculation",
                                       "eager-nospec": "metaloom eager, no speculation"}
METALOOM_MODES = {"graphs": "on", "graphs-torch": "on+torch", "graphs-mixed": "on+mixed", "eager": "off", "graphs-nospec": "on",
                  "eager-nospec": "off"}
DRAFTER = "ngram"


def graphs_rows() -> int:
    """The most rows the ``graphs`` row's step runs with Triton's kernels (``graphs-mixed`` differs
    from ``graphs`` only above it)."""
    from metaloom.models.engine.graphs import triton_rows

    return triton_rows()
# the speculative case's passage, which its prompt asks to copy (the drafter copies from the prompt)
PASSAGE = ("The city council met on Tuesday to discuss the new bicycle lanes on Main Street. Residents said the lanes "
           "made cycling safer, but several shop owners complained that the loss of parking hurt their business. "
           "The council agreed to count cyclists and parked cars for three months before deciding whether to keep "
           "the lanes, and asked the transport office to publish the counts every week.")
COPY_PROMPT = f"Copy the following passage exactly, word for word, twice.\n\n{PASSAGE}"
TRANSFORMERS = ("tf-eager", "tf-static")
RESERVE_S = 5.0  # kept back from the budget: freeing, the report
WORKER_FILE = os.path.abspath(gw.__file__)


@dataclass(frozen=True)
class Case:
    """One case as every system runs it (the worker's spec is `spec`)."""

    name: str
    label: str
    prompt_ids: tuple[int, ...]
    n: int
    max_tokens: int
    temperature: float
    seed: int
    num_draft: int | None = None  # speculative decoding with the n-gram drafter, this many tokens a step

    @property
    def expected_tokens(self) -> int:
        return self.n * self.max_tokens

    def spec(self) -> dict[str, Any]:
        return {"prompt_ids": list(self.prompt_ids), "n": self.n, "max_tokens": self.max_tokens,
                "temperature": self.temperature, "seed": self.seed}


@dataclass(frozen=True)
class ShapeRun:
    """A shape and the cases to run on it, in order."""

    shape: str
    cases: tuple[str, ...]


@dataclass(frozen=True)
class CallResult:
    seconds: float
    counts: tuple[int, ...]  # tokens per sequence
    digest: str
    ids: tuple[int, ...] | None  # a single sequence's ids (batch-1 greedy), else None
    usage: Any = None  # metaloom's `Usage` of the call (its ledger), where the row keeps it


class TokenCountError(Exception):
    """A system generated another number of tokens than the case asks for (its row's error)."""


class BaselineFailed(Exception):
    """The baseline worker process failed, timed out or imported the wrong package."""


# --- arguments -------------------------------------------------------------------------------------

def parse_shapes(value: str, default_cases: Sequence[str]) -> list[ShapeRun]:
    """``1b,7b:greedy+s16,135m`` -> shape runs in that order (a shape without cases gets
    ``default_cases``); an unknown shape or case is an `InvalidParameter`."""
    runs = []
    for item in (s.strip() for s in value.split(",")):
        if not item:
            continue
        shape, _, cases = item.partition(":")
        if shape not in gw.SHAPES:
            raise InvalidParameter("shapes", shape, f"a comma-separated list of {list(gw.SHAPES)}, each optionally "
                                                    f"SHAPE:CASE+CASE with cases of {list(CASES)}")
        chosen = names("shapes", cases.replace("+", ","), list(CASES)) if cases else list(default_cases)
        runs.append(ShapeRun(shape, tuple(chosen)))
    if not runs:
        raise InvalidParameter("shapes", value, f"at least one of {list(gw.SHAPES)}")
    return runs


def _positive(name: str, value: float, integer: bool = False) -> None:
    if (integer and (not isinstance(value, int) or isinstance(value, bool))) or not value > 0:
        raise InvalidParameter(name, value, "an integer >= 1" if integer else "a number > 0")


@dataclass(frozen=True)
class Options:
    shapes: tuple[ShapeRun, ...]
    systems: tuple[str, ...]
    baseline_cases: tuple[str, ...]
    static_cases: tuple[str, ...]
    repeats: int
    budget_s: float
    compile_s: float
    compile_share: float
    max_tokens: int | None
    seed: int
    dtype: str
    baseline_path: str | None
    spec_draft: int = 4


def options(args: argparse.Namespace) -> Options:
    """Every argument checked before anything is built."""
    from metaloom.models.engine.graphs import MAX_WIDTH
    from metaloom.models.load import DTYPES

    cases = names("cases", args.cases, list(CASES))
    shapes = parse_shapes(args.shapes, cases)
    systems = names("systems", args.systems, list(SYSTEMS))
    if not systems:
        raise InvalidParameter("systems", args.systems, f"a comma-separated subset of {list(SYSTEMS)}, not empty")
    _positive("repeats", args.repeats, integer=True)
    _positive("budget_s", args.budget_s)
    _positive("compile_s", args.compile_s)
    if not 0 <= args.compile_share <= 1:
        raise InvalidParameter("compile_share", args.compile_share, "a fraction in [0, 1]")
    if args.max_tokens is not None:
        _positive("max_tokens", args.max_tokens, integer=True)
    if args.dtype not in DTYPES:
        raise InvalidParameter("dtype", args.dtype, f"one of {sorted(DTYPES)}")
    k = args.spec_draft
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_WIDTH - 1:
        raise InvalidParameter("spec_draft", k, f"an integer in [1, {MAX_WIDTH - 1}] (a verify forward of the pending "
                                                f"token and K drafts, at most {MAX_WIDTH} tokens, takes the static step)")
    path = args.baseline_path
    if path is not None and not os.path.isfile(os.path.join(path, "metaloom", "__init__.py")):
        raise InvalidParameter("baseline_path", path, "a folder holding a metaloom package (DIR/metaloom/__init__.py)")
    if path is None:
        systems = [s for s in systems if s != "baseline"]
    return Options(shapes=tuple(shapes), systems=tuple(systems),
                   baseline_cases=tuple(names("baseline_cases", args.baseline_cases, list(CASES))),
                   static_cases=tuple(names("static_cases", args.static_cases, list(CASES))),
                   repeats=args.repeats, budget_s=float(args.budget_s), compile_s=float(args.compile_s),
                   compile_share=float(args.compile_share), max_tokens=args.max_tokens, seed=args.seed,
                   dtype=args.dtype, baseline_path=os.path.abspath(path) if path else None, spec_draft=k)


def make_cases(names: Sequence[str], table: Mapping[str, CaseShape], folder: str, seed: int,
               max_tokens: int | None, num_draft: int = 4) -> dict[str, Case]:
    """The cases' prompt token ids from the tokenizer in ``folder`` (the prompts of `metaloom
    bench decode`, and `COPY_PROMPT`); speculative cases draft ``num_draft`` tokens a step."""
    from metaloom.bench.decode import GREEDY_PROMPT, LONG_PROMPT
    from metaloom.models.engine.tokenizer import HFTokenizer

    tok = HFTokenizer(folder)
    prompts = {"chat": tuple(tok.encode(tok.apply_chat_template([{"role": "user", "content": GREEDY_PROMPT}]),
                                        add_special_tokens=False)),
               "long": tuple(tok.encode(LONG_PROMPT)),
               "copy": tuple(tok.encode(tok.apply_chat_template([{"role": "user", "content": COPY_PROMPT}]),
                                        add_special_tokens=False))}
    out = {}
    for name in names:
        c = table[name]
        tokens = min(c.max_tokens, max_tokens) if max_tokens else c.max_tokens
        ids = prompts[c.prompt]
        label = f"{c.label}, {c.n} x {tokens} tokens, {len(ids)}-token {c.prompt} prompt" + (
            f", temperature {c.temperature:g}, seeded" if c.temperature > 0 else "") + (
            f", {DRAFTER} drafter, K={num_draft} drafts a step" if c.speculative else "")
        out[name] = Case(name, label, ids, c.n, tokens, c.temperature, seed, num_draft if c.speculative else None)
    return out


# --- time -------------------------------------------------------------------------------------------

@dataclass
class Budget:
    """Seconds for the whole run, from ``start`` (`time.monotonic`)."""

    total_s: float
    start: float = field(default_factory=time.monotonic)
    compile_spent_s: float = 0.0

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def left(self) -> float:
        return self.total_s - RESERVE_S - self.elapsed()

    def fits(self, seconds: float) -> bool:
        return seconds <= self.left()


@dataclass
class Estimator:
    """Seconds of a call and a build: a prior scaled by what was measured, each system's
    (and the builds') largest ratio of measured (median) to prior seen so far, times a margin;
    a compilation: the longest seen so far, times the margin."""

    device_type: str
    copy_gbs: float
    compile_s: float
    margin: float = 1.25
    ratios: dict[str, list[float]] = field(default_factory=dict)

    def _scale(self, key: str, floor: float = 0.0) -> float:
        seen = self.ratios.get(key)
        return max(floor, max(seen) * self.margin) if seen else 1.0

    def observe(self, key: str, prior: float, actual: float) -> None:
        if prior > 0:
            self.ratios.setdefault(key, []).append(actual / prior)

    def prior_call(self, system: str, cfg: Mapping[str, Any], case: Case) -> float:
        """A rough, deliberately high guess of one call's seconds."""
        layers, rows = cfg["num_hidden_layers"], case.n
        params = gw.parameter_count(cfg)
        if self.device_type == "cuda":
            step = layers * 0.3e-3 + 3e-3 + rows * 0.12e-3 + gw.step_weight_bytes(cfg) / (0.5 * self.copy_gbs * 1e9)
            prefill = 0.1 + 2 * params * len(case.prompt_ids) * (rows if system in TRANSFORMERS else 1) / 2e14
        else:
            step = layers * 2e-3 + 10e-3 + rows * 1e-3 + 2 * params * rows / 2e10
            prefill = 2 * params * len(case.prompt_ids) * (rows if system in TRANSFORMERS else 1) / 2e10
        factor = 1.5 if system in TRANSFORMERS else 1.0
        return factor * (case.max_tokens * step + prefill)

    def call(self, system: str, cfg: Mapping[str, Any], case: Case) -> tuple[float, float]:
        """(estimated seconds, the prior it scales)."""
        prior = self.prior_call(system, cfg, case)
        return prior * self._scale(system), prior

    def prior_build(self, cfg: Mapping[str, Any]) -> float:
        return (3.0 if self.device_type == "cuda" else 5.0) + gw.parameter_count(cfg) / 1e9 * 2.0

    def build(self, cfg: Mapping[str, Any]) -> tuple[float, float]:
        prior = self.prior_build(cfg)
        return prior * self._scale("build", 1.0), prior

    def compile(self) -> float:
        """The longest compiling warm-up seen so far (a margin added), else ``compile_s``."""
        seen = self.ratios.get("compile")
        return max(seen) * self.compile_s * self.margin if seen else self.compile_s


# --- the baseline worker ------------------------------------------------------------------------------

def _pump(stream: IO[str], lines: queue.Queue[str | None]) -> None:
    for line in stream:
        lines.put(line)
    lines.put(None)


class BaselineWorker:
    """`metaloom.bench.gpu_worker` run with ``PYTHONPATH`` starting at ``path`` (``python -P``:
    nothing else prepended), so ``import metaloom`` there is the older copy's."""

    def __init__(self, path: str) -> None:
        self.path = path
        inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                     if p and not os.path.isfile(os.path.join(p, "metaloom", "__init__.py"))]
        env = {k: v for k, v in os.environ.items() if k != gw.GRAPHS_ENV}
        env |= {"PYTHONPATH": os.pathsep.join([path, *inherited]), "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115  # read back for the reason of a failure
        self.proc = subprocess.Popen([sys.executable, "-P", WORKER_FILE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._stderr, env=env, text=True, start_new_session=True)
        self._lines: queue.Queue[str | None] = queue.Queue()
        assert self.proc.stdout is not None
        threading.Thread(target=_pump, args=(self.proc.stdout, self._lines), daemon=True).start()
        self.checked = False

    def hello(self, timeout_s: float) -> str:
        """The metaloom package the worker imported (`BaselineFailed` unless under ``path``)."""
        where = str(self.request({"op": "hello"}, timeout_s)["metaloom"])
        if not os.path.realpath(where).startswith(os.path.realpath(self.path) + os.sep):
            raise BaselineFailed(f"the worker imported metaloom from {where}, not from {self.path}")
        self.checked = True
        return where

    def request(self, msg: Mapping[str, Any], timeout_s: float) -> dict[str, Any]:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(msg) + "\n")
            self.proc.stdin.flush()
        except OSError:
            raise BaselineFailed(f"the worker is gone{self._tail()}") from None
        try:
            line = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            self.kill()
            raise BaselineFailed(f"no reply to {msg.get('op')!r} in {timeout_s:.0f} s (killed){self._tail()}") from None
        if line is None:
            raise BaselineFailed(f"the worker exited{self._tail()}")
        reply: dict[str, Any] = json.loads(line)
        if not reply.get("ok"):
            raise BaselineFailed(str(reply.get("error")))
        return reply

    def _tail(self, lines: int = 3) -> str:
        self._stderr.seek(0, os.SEEK_END)
        self._stderr.seek(max(0, self._stderr.tell() - 4096))
        tail = [s.strip() for s in self._stderr.read().decode(errors="replace").splitlines() if s.strip()][-lines:]
        return (": " + " | ".join(tail)) if tail else ""

    def kill(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, 9)
            self.proc.wait()

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(BaselineFailed, json.JSONDecodeError):
                self.request({"op": "quit"}, 30)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=30)
        self.kill()
        self._stderr.close()


# --- measuring ------------------------------------------------------------------------------------------

def copy_bandwidth(device: str, repeats: int = 10) -> float:
    """GB/s of a device-to-device copy (bytes read + written), median of ``repeats``; 1 GiB on
    a GPU, 64 MiB elsewhere."""
    import torch

    size = (1 << 30) if torch.device(device).type == "cuda" else (64 << 20)
    a = torch.ones(size // 2, dtype=torch.bfloat16, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    times = []
    for _ in range(repeats):
        gw.synchronize(device)
        start = time.perf_counter()
        b.copy_(a)
        gw.synchronize(device)
        times.append(time.perf_counter() - start)
    del a, b
    gw.free_device_memory(device)
    return 2 * size / statistics.median(times) / 1e9


def _result(seconds: float, seqs: Sequence[Sequence[int]]) -> CallResult:
    return CallResult(seconds, tuple(len(s) for s in seqs), gw.digest(seqs), tuple(seqs[0]) if len(seqs) == 1 else None)


def checked(result: CallResult, case: Case) -> CallResult:
    if sum(result.counts) != case.expected_tokens or any(c != case.max_tokens for c in result.counts):
        raise TokenCountError(f"generated {sum(result.counts)} tokens ({len(result.counts)} sequences), "
                              f"expected {case.expected_tokens} ({case.n} x {case.max_tokens})")
    return result


@dataclass
class Shape:
    """A built shape: its config, the transformers model, metaloom's generator and requests."""

    name: str
    cfg: dict[str, Any]
    model: Any
    gen: Any
    requests: dict[str, Any]
    checksum: float
    build_s: float
    compiled: bool = False  # transformers compiled something for this model


def build_shape(name: str, vocab: int, device: str, dtype: str, seed: int, folder: str, cases: Mapping[str, Case]) -> Shape:
    start = time.perf_counter()
    cfg = gw.hf_config(name, vocab)
    model = gw.build_transformers(cfg, device, dtype, seed)
    total = gw.checksum(model)
    gen = gw.metaloom_generator(model, cfg, folder, device, dtype, f"random {name}")
    requests = gw.requests({c.name: c.spec() for c in cases.values()})
    gw.synchronize(device)
    return Shape(name, cfg, model, gen, requests, total, time.perf_counter() - start)


def free_shape(shape: Shape, device: str) -> None:
    if shape.compiled:
        import torch

        torch._dynamo.reset()  # the compiled graphs and their CUDA graph memory
    shape.model = shape.gen = None
    shape.requests = {}
    gw.free_device_memory(device)


def _error(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300] if text else ''}"


@dataclass
class Runner:
    """One benchmark run: the device, the options, the budget, the baseline worker and the report."""

    opts: Options
    device: str
    folder: str
    vocab: int
    budget: Budget
    estimator: Estimator
    report: dict[str, Any]
    cases: Mapping[str, Case]
    out: str | None
    log: Callable[[str], None]
    baseline: BaselineWorker | None = None
    baseline_error: str | None = None
    baseline_shape: str | None = None
    graph_counts: dict[str, dict[str, int]] = field(default_factory=dict)  # per system, over the current cell

    def save(self) -> None:
        self.report["elapsed_s"] = self.budget.elapsed()
        if self.out:
            tmp = self.out + ".tmp"
            with open(tmp, "w") as f:
                json.dump(self.report, f, indent=1)
            os.replace(tmp, self.out)

    def skip_row(self, shape: str, case: Case, system: str, why: str) -> None:
        self.report["rows"].append(_row(shape, case, system) | {"error": why})

    # each system's one call
    def caller(self, system: str, shape: Shape, case: Case, static_compile: list[bool]) -> Callable[[], CallResult]:
        dev = self.device
        if system in METALOOM_MODES:
            req, mode = shape.requests[case.name], METALOOM_MODES[system]
            counts = self.graph_counts.setdefault(system, {})
            spec = gw.ngram_speculative(case.num_draft) if case.num_draft and system in NO_SPECULATION else None
            keep_usage = case.num_draft is not None  # the speculative case's rows report their ledgers

            def metaloom() -> CallResult:
                from metaloom.ledger import Ledger

                before = gw.graph_counters(shape.gen)
                ledger = Ledger()
                result = _result(*gw.metaloom_call(shape.gen, req, dev, mode, ledger=ledger, speculative=spec))
                if keep_usage:
                    result = dataclasses.replace(result, usage=ledger.usage)
                after = gw.graph_counters(shape.gen)
                if before is not None and after is not None:
                    for k, v in after.items():
                        counts[k] = counts.get(k, 0) + v - before.get(k, 0)
                    counts["calls"] = counts.get("calls", 0) + 1
                return result
            return metaloom
        if system == "tf-eager":
            return lambda: _result(*gw.transformers_call(shape.model, case.spec(), dev))
        if system == "tf-static":
            return lambda: _result(*gw.transformers_call(shape.model, case.spec(), dev, static=True,
                                                         compile=static_compile[0]))
        assert system == "baseline" and self.baseline is not None
        worker = self.baseline

        def baseline_call() -> CallResult:
            r = worker.request({"op": "run", "case": case.name}, timeout_s=max(120.0, 20 * self.estimator.call(system, shape.cfg,
                                                                                                               case)[0]))
            ids = r.get("ids")
            return CallResult(float(r["seconds"]), tuple(r["tokens"]), str(r["digest"]), tuple(ids) if ids else None)
        return baseline_call

    def ensure_baseline(self, shape: Shape) -> None:
        """The worker started, checked and holding ``shape`` (`BaselineFailed` if it cannot)."""
        if self.baseline_error is not None:
            raise BaselineFailed(self.baseline_error)
        assert self.baseline is not None
        try:
            if not self.baseline.checked:
                self.report["baseline"]["metaloom"] = self.baseline.hello(timeout_s=max(30.0, min(180.0, self.budget.left())))
            if self.baseline_shape != shape.name:
                est, prior = self.estimator.build(shape.cfg)
                if not self.budget.fits(est):
                    raise BaselineFailed(f"time budget: building the shape takes ~{est:.0f} s, {self.budget.left():.0f} s left")
                reply = self.baseline.request({"op": "build", "config": shape.cfg, "seed": self.opts.seed, "device": self.device,
                                               "dtype": self.opts.dtype, "tokenizer": self.folder,
                                               "cases": {c.name: c.spec() for c in self.cases.values()}},
                                              timeout_s=max(60.0, 10 * est))
                self.estimator.observe("build", prior, float(reply["build_s"]))
                self.baseline_shape = shape.name
                same = reply["checksum"] == shape.checksum
                self.report["shapes"][shape.name]["baseline_build_s"] = reply["build_s"]
                self.report["shapes"][shape.name]["baseline_same_weights"] = same
                if not same:
                    self.log(f"  baseline weights differ (checksum {reply['checksum']} vs {shape.checksum})")
        except BaselineFailed as exc:
            if not str(exc).startswith("time budget"):
                self.baseline_error = str(exc)
                self.baseline.kill()
            raise

    def run_cell(self, shape: Shape, case: Case, systems: Sequence[str]) -> None:
        """``systems`` on one case, rows appended: first those that do not compile (a warm-up
        each, then alternating timed rounds), saved; then a compiling transformers static on its
        own (its compilation, a second warm-up, its rounds), so a compilation that runs long
        cannot cost the other rows their timed rounds."""
        compiling = [s for s in systems if s == "tf-static" and transformers_compiles(self.device)]
        rows: dict[str, dict[str, Any]] = {}
        self.graph_counts = {}
        for group in ([s for s in systems if s not in compiling], compiling):
            if not group:
                continue
            measured = self._measure(shape, case, group)
            if group is compiling:
                for row in measured.values():
                    row["note"] = _join(row.get("note"), "timed after the other rows, not alternated with them")
            rows |= measured
            self.report["rows"] += list(measured.values())
            self._compare(rows, case, shape)
            for row in measured.values():
                if row.get("tok_s"):
                    self.log(f"  {row['system']:<20} {row['tok_s']:9.1f} tok/s  step {row['step_ms']:.2f} ms"
                             + (f"  {100 * row['bandwidth_fraction']:.0f}% of copy bandwidth"
                                if row.get("bandwidth_fraction") else "")
                             + (f"  {_spec_note(row)}" if row.get("forward_passes") is not None else ""))
            self.save()

    def _compare(self, rows: dict[str, dict[str, Any]], case: Case, shape: Shape) -> None:
        """Each row's tokens against metaloom eager's (transformers' samples draw other random
        numbers: compared only when greedy), and the engine's graph counters."""
        for system, counts in self.graph_counts.items():
            if counts and system in rows:
                rows[system]["graph_counters"] = counts  # the engine's StepGraphs counters, warm-up included
                captured = METALOOM_MODES.get(system, "").startswith("on") and self.device.startswith("cuda")
                if captured and rows[system].get("tok_s") and not counts.get("replays"):
                    rows[system]["note"] = _join(rows[system].get("note"), "no CUDA graph replays")
                if system == "graphs" and self.device.startswith("cuda") and not counts.get("triton_steps"):
                    rows[system]["note"] = _join(rows[system].get("note"), "PyTorch ops (no Triton kernels ran)")
        if "graphs" in rows and shape.gen is not None and (failed := gw.graph_failures(shape.gen)):
            rows["graphs"]["capture_failures"] = failed  # the row then ran the static step uncaptured
        eager = rows.get("eager", {})
        for system, row in rows.items():
            comparable = system in ("graphs", "baseline") or case.temperature == 0
            if comparable and eager.get("digest") and row.get("digest") and system != "eager":
                row["same_tokens_as_eager"] = row["digest"] == eager["digest"]
                if case.n == 1 and row.get("token_ids") and eager.get("token_ids"):
                    a, b = row["token_ids"], eager["token_ids"]
                    row["first_difference"] = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)

    def _measure(self, shape: Shape, case: Case, systems: Sequence[str]) -> dict[str, dict[str, Any]]:
        """A warm-up of each system that fits the budget, then ``repeats`` rounds alternating them
        while the next call fits; {system: row}."""
        o, est = self.opts, self.estimator
        rows: dict[str, dict[str, Any]] = {}
        calls: dict[str, Callable[[], CallResult]] = {}
        results: dict[str, list[CallResult]] = {}
        priors: dict[str, float] = {}
        for system in systems:
            row = _row(shape.name, case, system)
            rows[system] = row
            if system == "graphs-mixed" and case.n <= graphs_rows():
                row["error"] = f"the same step as graphs at {case.n} rows (Triton's step up to {graphs_rows()})"
                continue
            guess, priors[system] = est.call(system, shape.cfg, case)
            compiling = system == "tf-static" and transformers_compiles(self.device)
            static_compile = [compiling]
            cost = guess * (1 + o.repeats)
            if compiling:
                compile_guess = est.compile()
                share_left = o.compile_share * o.budget_s - self.budget.compile_spent_s
                if compile_guess > share_left or not self.budget.fits(cost + compile_guess):
                    row["error"] = (f"time budget: compiling takes ~{compile_guess:.0f} s, {self.budget.left():.0f} s left "
                                    f"({max(0.0, share_left):.0f} s of them for compiling)")
                    self.log(f"  {ROW_NAMES[system]}: {row['error']}")
                    continue
                cost += compile_guess
            if not self.budget.fits(cost):
                row["error"] = f"time budget: ~{cost:.0f} s needed, {self.budget.left():.0f} s left"
                self.log(f"  {ROW_NAMES[system]}: {row['error']}")
                continue
            try:
                if system == "baseline":
                    self.ensure_baseline(shape)
                call = self.caller(system, shape, case, static_compile)
                if compiling:
                    self._compile(row, call, case, static_compile, shape)
                elif system == "tf-static":
                    row["compiled"] = False
                    row["note"] = f"not compiled on {self.device} (transformers compiles on CUDA)"
                start = time.monotonic()
                first = checked(call(), case)
                row["warmup_s"] = time.monotonic() - start
                row["warmup_call_s"] = first.seconds
                calls[system], results[system] = call, []
            except (TokenCountError, BaselineFailed) as exc:
                row["error"] = str(exc)
            except Exception as exc:  # a system failing is its row's result, not the run's end
                row["error"] = _error(exc)
                gw.free_device_memory(self.device)
            if row.get("error"):
                self.log(f"  {ROW_NAMES[system]}: {row['error']}")
        for r in range(o.repeats):
            for system, call in list(calls.items()):
                done = results[system]
                guess = statistics.median(x.seconds for x in done) if done else rows[system]["warmup_s"]
                if not self.budget.fits(guess):
                    rows[system]["note"] = _join(rows[system].get("note"), f"time budget: {r} of {o.repeats} rounds")
                    del calls[system]
                    continue
                try:
                    done.append(checked(call(), case))
                except (TokenCountError, BaselineFailed) as exc:
                    rows[system]["error"] = str(exc)
                    del calls[system]
                except Exception as exc:
                    rows[system]["error"] = _error(exc)
                    del calls[system]
                    gw.free_device_memory(self.device)
        for system, row in rows.items():
            done = results.get(system, [])
            if done and not row.get("error"):
                _fill(row, done, case, self.weight_bytes(shape.cfg), self.report["device"]["copy_bandwidth_gb_s"])
                est.observe(system, priors[system], row["median_s"])
            elif not row.get("error"):
                row["error"] = "time budget: no timed round fitted"
        return rows

    def _compile(self, row: dict[str, Any], call: Callable[[], CallResult], case: Case, static_compile: list[bool],
                 shape: Shape) -> None:
        """transformers static's first call, which compiles; when compiling fails, the row's note
        says why and ``static_compile`` turns compiling off for its other calls."""
        row["compiled"] = True
        shape.compiled = True  # dynamo holds state for this model (also after a failure): reset with the shape
        self.log(f"  {SYSTEMS['tf-static']}: compiling (first call)")
        start = time.monotonic()
        try:
            checked(call(), case)
        except TokenCountError:
            raise
        except Exception as exc:  # torch.compile's many error types: the row says which
            row["compiled"] = False
            row["note"] = f"torch.compile failed ({_error(exc)}); measured without compiling"
            static_compile[0] = False
            gw.free_device_memory(self.device)
        finally:
            spent = time.monotonic() - start
            self.budget.compile_spent_s += spent
            row["compile_warmup_s"] = spent
            self.estimator.observe("compile", self.opts.compile_s, spent)
        self.log(f"  {SYSTEMS['tf-static']}: first call {spent:.1f} s" + ("" if row["compiled"] else f"; {row['note']}"))

    def run_shape(self, spec: ShapeRun) -> None:
        cases = self.cases
        cfg = gw.hf_config(spec.shape, self.vocab)
        guess, prior = self.estimator.build(cfg)
        first = cases[spec.cases[0]]
        cheapest = min(self.estimator.call(s, cfg, first)[0]
                       for s in self._systems_for(first.name) or self.opts.systems) * (1 + self.opts.repeats)
        if not self.budget.fits(guess + cheapest):
            for c in spec.cases:
                for system in self._systems_for(c):
                    self.skip_row(spec.shape, cases[c], system, f"time budget: the shape takes ~{guess:.0f} s to build "
                                                                f"and ~{cheapest:.0f} s for its first cell, "
                                                                f"{self.budget.left():.0f} s left")
            self.log(f"{spec.shape}: skipped (time budget)")
            self.save()
            return
        self.log(f"{spec.shape}: building ({gw.parameter_count(cfg) / 1e6:,.1f}M parameters)")
        try:
            shape = build_shape(spec.shape, self.vocab, self.device, self.opts.dtype, self.opts.seed, self.folder, cases)
        except Exception as exc:  # out of memory, a transformers that cannot build it: the shape's rows say so
            gw.free_device_memory(self.device)
            for c in spec.cases:
                for system in self._systems_for(c):
                    self.skip_row(spec.shape, cases[c], system, f"building the shape failed: {_error(exc)}")
            self.log(f"{spec.shape}: building failed: {_error(exc)}")
            self.save()
            return
        self.estimator.observe("build", prior, shape.build_s)
        info = self.report["shapes"].setdefault(spec.shape, {})
        info |= {"config": cfg, "parameters": gw.parameter_count(cfg), "step_weight_bytes": self.weight_bytes(cfg),
                 "build_s": shape.build_s, "checksum": shape.checksum}
        self.log(f"{spec.shape}: built in {shape.build_s:.1f} s")
        try:
            for c in spec.cases:
                self.log(f"{spec.shape} {c}: {cases[c].label}")
                self.run_cell(shape, cases[c], self._systems_for(c))
        finally:
            free_shape(shape, self.device)
            if self.baseline is not None and self.baseline_shape == spec.shape:
                self.baseline_shape = None
                try:
                    self.baseline.request({"op": "free"}, 60)
                except BaselineFailed as exc:
                    self.baseline_error = str(exc)
        _ratios(self.report, spec.shape)
        self.save()

    def weight_bytes(self, cfg: Mapping[str, Any]) -> int:
        """Weight bytes one batch-1 step reads, in this run's dtype."""
        import torch

        return gw.step_weight_bytes(cfg, getattr(torch, self.opts.dtype).itemsize)

    def _systems_for(self, case: str) -> list[str]:
        """The rows of ``case``: the chosen systems; for a speculative case metaloom's only, and
        the same engine without speculation (graphs on, else off) as a reference."""
        o = self.opts
        if CASES[case].speculative:
            engines = [s for s in o.systems if s in NO_SPECULATION]
            return [*engines, NO_SPECULATION[engines[0]]] if engines else []
        return [s for s in o.systems if (s != "baseline" or case in o.baseline_cases)
                and (s != "tf-static" or case in o.static_cases)]


def transformers_compiles(device: str) -> bool:
    """Whether ``generate`` with a static cache compiles the model on ``device`` (transformers
    compiles on CUDA, not on the CPU)."""
    return device.startswith("cuda")


def _join(a: str | None, b: str) -> str:
    return f"{a}; {b}" if a else b


def _row(shape: str, case: Case, system: str) -> dict[str, Any]:
    return {"shape": shape, "case": case.name, "system": ROW_NAMES[system], "key": system,
            "expected_tokens": case.expected_tokens, "error": None, "note": None}


def _fill(row: dict[str, Any], done: Sequence[CallResult], case: Case, weight_bytes: int, copy_gbs: float) -> None:
    secs = [r.seconds for r in done]
    med = statistics.median(secs)
    tokens = sum(done[-1].counts)
    row |= {"tokens": tokens, "repeats": len(done), "seconds": secs, "median_s": med, "tok_s": tokens / med,
            "tok_s_min": tokens / max(secs), "tok_s_max": tokens / min(secs), "step_ms": 1e3 * med / case.max_tokens,
            "digest": done[0].digest, "deterministic": len({r.digest for r in done}) == 1}
    if done[0].ids is not None:
        row["token_ids"] = list(done[0].ids)
    speculative = case.num_draft is not None and row["key"] in NO_SPECULATION
    if case.n == 1 and case.temperature == 0 and not speculative:  # a step per token: the weights read once a token
        gbs = weight_bytes / (med / case.max_tokens) / 1e9
        row |= {"weight_gb_s": gbs, "bandwidth_fraction": gbs / copy_gbs}
    if (u := done[0].usage) is not None:
        _fill_usage(row, u, med, speculative, case)


def _fill_usage(row: dict[str, Any], u: Any, median_s: float, speculative: bool, case: Case) -> None:
    """A speculative case's row: its call's ledger (the first timed call's; greedy calls charge
    alike) and what it gives: forward passes (the prompt's prefill included), tokens and
    milliseconds per forward, and with speculation the drafts, accepted tokens per verify step
    (0 .. K) and the acceptance rate."""
    ledger = {k: getattr(u, k) for k in ("output_tokens", "forward_passes", "drafted_tokens", "accepted_tokens",
                                         "rejected_tokens", "verify_steps")}
    row |= {"ledger": ledger, "forward_passes": u.forward_passes,
            "tokens_per_forward": u.output_tokens / u.forward_passes if u.forward_passes else None,
            "forward_ms": 1e3 * median_s / u.forward_passes if u.forward_passes else None,
            "speculation": None}
    if speculative:
        row["speculation"] = {"drafter": DRAFTER, "num_draft": case.num_draft, "accepted_per_step": u.accepted_per_step,
                              "acceptance_rate": u.acceptance_rate, "verify_steps": u.verify_steps}


def _spec_note(row: Mapping[str, Any]) -> str:
    """A speculative case's row in a few words: forward passes, and accepted drafts per verify step."""
    text = f"{row['forward_passes']} forwards"
    if (sp := row.get("speculation")) and sp["accepted_per_step"] is not None:
        rate = "" if sp["acceptance_rate"] is None else f", {100 * sp['acceptance_rate']:.0f}% of drafts"
        text += f", {sp['accepted_per_step']:.2f} of K={sp['num_draft']} drafts accepted per verify step{rate}"
    elif sp:
        text += ", nothing drafted"
    return text


def _ratios(report: dict[str, Any], shape: str) -> None:
    """Per case of ``shape``: metaloom graphs over the best transformers row, over the graphs
    without Triton's kernels, over metaloom eager and over the baseline (tokens/s ratios)."""
    out: dict[str, Any] = {}
    by_case: dict[str, dict[str, dict[str, Any]]] = {}
    for row in report["rows"]:
        if row["shape"] == shape and row.get("tok_s"):
            by_case.setdefault(row["case"], {})[row["key"]] = row
    for case, rows in by_case.items():
        r: dict[str, Any] = {}
        graphs = rows.get("graphs")
        best = max((rows[k] for k in TRANSFORMERS if k in rows), key=lambda x: x["tok_s"], default=None)
        if best is not None:
            r["best_transformers"] = best["system"]
        if graphs is not None:
            if best is not None:
                r["graphs_vs_best_transformers"] = graphs["tok_s"] / best["tok_s"]
            for key in ("graphs-torch", "graphs-mixed", "eager", "baseline"):
                if key in rows:
                    r[f"graphs_vs_{key}"] = graphs["tok_s"] / rows[key]["tok_s"]
        for key, plain in NO_SPECULATION.items():  # the speculative case: speculation's speed-up
            if key in rows and plain in rows:
                r[f"{key}_speculation_speedup"] = rows[key]["tok_s"] / rows[plain]["tok_s"]
        out[case] = r
    report["shapes"].setdefault(shape, {})["ratios"] = out


# --- entry points -------------------------------------------------------------------------------------------

def _setup(args: argparse.Namespace) -> tuple[str, str, int]:
    """(device, tokenizer folder, vocabulary size)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from metaloom.models.engine.tokenizer import HFTokenizer
    from metaloom.models.load import pick_device, resolve

    device = pick_device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InvalidParameter("device", args.device, "cpu here: CUDA is not available")
    folder = os.path.abspath(args.tokenizer) if args.tokenizer else resolve("default")[1]
    vocab = HFTokenizer(folder).vocab_size
    return str(device), folder, vocab


def _versions(device: str, copy_gbs: float | None) -> dict[str, Any]:
    import importlib.metadata

    import torch

    def version(name: str) -> str | None:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    is_cuda = device.startswith("cuda")
    return {"device": device, "name": torch.cuda.get_device_name(device) if is_cuda else "cpu",
            "torch": torch.__version__, "cuda": torch.version.cuda, "transformers": version("transformers"),
            "triton": version("triton"), "python": sys.version.split()[0], "copy_bandwidth_gb_s": copy_gbs}


def run(args: argparse.Namespace, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The benchmark (see the module docstring); the report, also written to ``args.out``."""
    say = log or (lambda s: print(s, file=sys.stderr, flush=True))
    start = time.monotonic()
    opts = options(args)
    budget = Budget(opts.budget_s, start)
    device, folder, vocab = _setup(args)
    wanted = list(dict.fromkeys(c for s in opts.shapes for c in s.cases))
    cases = make_cases(wanted, CASES, folder, opts.seed, opts.max_tokens, opts.spec_draft)
    baseline = BaselineWorker(opts.baseline_path) if opts.baseline_path and "baseline" in opts.systems else None
    try:
        copy_gbs = copy_bandwidth(device)
        report: dict[str, Any] = {
            "benchmark": "gpu", "device": _versions(device, copy_gbs), "dtype": opts.dtype, "repeats": opts.repeats,
            "warmup": 1, "budget_s": opts.budget_s, "seed": opts.seed, "tokenizer": folder, "vocab_size": vocab,
            "graphs_env": gw.GRAPHS_ENV, "graphs_env_before": os.environ.get(gw.GRAPHS_ENV),
            "cases": {c.name: {"label": c.label, "prompt_tokens": len(c.prompt_ids), "sequences": c.n,
                               "tokens_per_sequence": c.max_tokens, "expected_tokens": c.expected_tokens,
                               "temperature": c.temperature}
                      | ({"speculative": {"drafter": DRAFTER, "num_draft": c.num_draft}} if c.num_draft else {})
                      for c in cases.values()},
            "systems": {k: SYSTEMS[k] for k in opts.systems},
            "spec_draft": opts.spec_draft,
            "plan": [{"shape": s.shape, "cases": list(s.cases)} for s in opts.shapes],
            "baseline": {"path": opts.baseline_path, "cases": list(opts.baseline_cases)} if baseline else None,
            "shapes": {}, "rows": [], "complete": False}
        say(f"{report['device']['name']}: torch {report['device']['torch']}, transformers "
            f"{report['device']['transformers']}; copy bandwidth {copy_gbs:.0f} GB/s")
        runner = Runner(opts, device, folder, vocab, budget,
                        Estimator(device.split(":")[0], copy_gbs, opts.compile_s), report, cases, args.out, say, baseline)
        for spec in opts.shapes:
            runner.run_shape(spec)
        if runner.baseline_error:
            report["baseline"]["error"] = runner.baseline_error
        report["complete"] = True
        runner.save()
        return report
    finally:
        if baseline is not None:
            baseline.close()


def smoke(args: argparse.Namespace, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """metaloom's token ids with METALOOM_CUDA_GRAPHS on and off, per ``--smoke-dtypes`` and
    shape: greedy and 4 seeded samples, each run with graphs on, off, and on again; equal or
    not, where they first differ, and the largest difference of the chosen tokens'
    log-probabilities between on and off while their tokens agree (0 when the captured steps
    compute exactly what eager ones do). ``ok``: equal in float32, where rounding cannot flip a
    token (in bfloat16 two correct paths whose kernels round differently part ways at a near
    tie: reported, not failed); all equal when float32 is not among the dtypes. Greedy also
    runs transformers once: whether its tokens equal metaloom's (information only)."""
    say = log or (lambda s: print(s, file=sys.stderr, flush=True))
    opts = options(args)
    device, folder, vocab = _setup(args)
    cases = make_cases(list(SMOKE_CASES), SMOKE_CASES, folder, opts.seed, opts.max_tokens)
    from metaloom.models.load import DTYPES

    dtypes = names("smoke_dtypes", args.smoke_dtypes, list(DTYPES))
    checks = []
    for dtype, spec in ((d, s) for d in dtypes for s in opts.shapes):
        shape = build_shape(spec.shape, vocab, device, dtype, opts.seed, folder, cases)
        try:
            for case in cases.values():
                checks.append({"dtype": dtype} | _smoke_case(shape, case, device))
                c = checks[-1]
                say(f"smoke {spec.shape} {dtype} {case.name}: graphs on/off/on {'EQUAL' if c['equal'] else 'DIFFER'}"
                    + "".join(f"; {k} {v['seconds']:.2f} s" if "seconds" in v else f"; {k} {v['error']}"
                              for k, v in c["runs"].items())
                    + (f"; first difference at token {c['first_difference']}" if c.get("first_difference") is not None
                       else "")
                    + (f"; log-probabilities differ by up to {c['max_logprob_difference']:.2g}"
                       if c.get("max_logprob_difference") is not None else "")
                    + (f"; transformers greedy {'equal' if c['transformers_equal'] else 'differs'}"
                       if "transformers_equal" in c else ""))
        finally:
            free_shape(shape, device)
    strict = [c for c in checks if c["dtype"] == "float32"] or checks
    report = {"benchmark": "gpu smoke", "device": _versions(device, None), "checks": checks,
              "ok": all(c["equal"] for c in strict), "ok_means": "equal in float32" if strict is not checks else "equal"}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return report


def _smoke_case(shape: Shape, case: Case, device: str) -> dict[str, Any]:
    req = shape.requests[case.name]
    runs: dict[str, dict[str, Any]] = {}
    seqs: dict[str, tuple[list[list[int]], list[list[float]]]] = {}
    for label, mode in (("on", "on"), ("off", "off"), ("on again", "on")):
        logprobs: list[list[float]] = []
        try:
            seconds, ids = gw.metaloom_call(shape.gen, req, device, mode, logprobs)
            r = checked(_result(seconds, ids), case)
            runs[label] = {"seconds": r.seconds, "digest": r.digest}
            seqs[label] = (ids, logprobs)
        except Exception as exc:  # reported as the check's failure
            runs[label] = {"error": _error(exc)}
    digests = {v.get("digest") for v in runs.values()}
    check: dict[str, Any] = {"shape": shape.name, "case": case.name, "label": case.label,
                             "equal": len(digests) == 1 and None not in digests, "runs": runs}
    if "on" in seqs and "off" in seqs:
        (a_ids, a_lp), (b_ids, b_lp) = seqs["on"], seqs["off"]
        firsts, diffs = [], []
        for x, y, lx, ly in zip(a_ids, b_ids, a_lp, b_lp, strict=True):
            first = next((i for i, (p, q) in enumerate(zip(x, y, strict=False)) if p != q), None)
            firsts.append(first)
            agree = len(x) if first is None else first
            diffs += [abs(p - q) for p, q in zip(lx[:agree], ly[:agree], strict=False)]
        check["first_difference"] = min((f for f in firsts if f is not None), default=None)
        check["max_logprob_difference"] = max(diffs, default=None)
        if case.n == 1:
            check["ids"] = {"on": a_ids[0], "off": b_ids[0]}
    if case.temperature == 0 and "off" in seqs:
        try:
            _, tf = gw.transformers_call(shape.model, case.spec(), device)
            check["transformers_equal"] = tf == seqs["off"][0]
            if not check["transformers_equal"]:
                check["transformers_first_difference"] = next(
                    (i for i, (p, q) in enumerate(zip(tf[0], seqs["off"][0][0], strict=False)) if p != q), None)
        except Exception as exc:  # information only
            check["transformers_error"] = _error(exc)
    return check


def format_report(report: dict[str, Any]) -> str:
    d = report["device"]
    lines = [f"{d['name']} ({d['device']}): torch {d['torch']}, transformers {d['transformers']}; copy bandwidth "
             f"{d['copy_bandwidth_gb_s']:.0f} GB/s; {report['dtype']}; median (min-max) tok/s of up to {report['repeats']} "
             f"alternating rounds after a warm-up; {report['elapsed_s']:.0f} s of a {report['budget_s']:.0f} s budget"
             + ("" if report["complete"] else " (INCOMPLETE)")]
    lines += [f"  {name}: {c['label']}" for name, c in report["cases"].items()]
    width = max([19] + [len(row["system"]) for row in report["rows"]])
    lines.append(f"{'shape':<5} {'case':<6} {'system':<{width}} {'tok/s':>9} {'(min-max)':>17} {'step ms':>8} {'bw':>5}  note")
    for row in report["rows"]:
        head = f"{row['shape']:<5} {row['case']:<6} {row['system']:<{width}}"
        if row.get("error"):
            lines.append(f"{head} {'-':>9} {'':>17} {'':>8} {'':>5}  {row['error']}")
            continue
        span = f"({row['tok_s_min']:.0f}-{row['tok_s_max']:.0f})"
        bw = f"{100 * row['bandwidth_fraction']:.0f}%" if row.get("bandwidth_fraction") is not None else ""
        notes = [row["note"]] if row.get("note") else []
        if row.get("forward_passes") is not None:
            notes.append(_spec_note(row))
        if row.get("same_tokens_as_eager") is False:
            notes.append("tokens differ from eager" + (f" at {row['first_difference']}" if row.get("first_difference")
                                                        is not None else ""))
        if row.get("compile_warmup_s"):
            notes.append(f"compile warm-up {row['compile_warmup_s']:.0f} s")
        lines.append(f"{head} {row['tok_s']:9.1f} {span:>17} {row['step_ms']:8.2f} {bw:>5}  {'; '.join(notes)}")
    for shape, info in report["shapes"].items():
        parts = []
        for case, r in info.get("ratios", {}).items():
            if "graphs_vs_best_transformers" in r:
                parts.append(f"{case} {r['graphs_vs_best_transformers']:.2f}x {r['best_transformers']}")
        if parts:
            lines.append(f"{shape}: metaloom graphs vs the best transformers row: " + ", ".join(parts))
        for case, r in info.get("ratios", {}).items():
            speedups = [f"{key} {r[f'{key}_speculation_speedup']:.2f}x" for key in NO_SPECULATION
                        if f"{key}_speculation_speedup" in r]
            if speedups:
                lines.append(f"{shape} {case}: speculation vs none (tok/s), metaloom " + ", ".join(speedups))
    if (b := report.get("baseline")) and b.get("error"):
        lines.append(f"baseline: {b['error']}")
    return "\n".join(lines)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shapes", default="1b,7b,135m",
                   help=f"shapes in the order to run, comma-separated, of {', '.join(gw.SHAPES)}; SHAPE:CASE+CASE "
                        "names that shape's cases")
    p.add_argument("--cases", default=",".join(DEFAULT_CASES),
                   help=f"cases of shapes that name none, of {', '.join(CASES)} (spec only when named)")
    p.add_argument("--systems", default=DEFAULT_SYSTEMS, help=f"rows, comma-separated, of {', '.join(SYSTEMS)} "
                                                              "(baseline only with --baseline-path)")
    p.add_argument("--tokenizer", default=None, metavar="FOLDER",
                   help="a tokenizer folder (tokenizer.json ...); default: the default model's")
    p.add_argument("--device", default="auto", help="auto (CUDA when present) | cpu | cuda | cuda:N")
    p.add_argument("--dtype", default="bfloat16", help="float32 | bfloat16 | float16")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds after a warm-up (medians)")
    p.add_argument("--json", action="store_true", help="print the report as JSON (the table goes to stderr)")
    p.add_argument("--out", default=None, metavar="FILE", help="write the JSON report here (rewritten after every cell)")
    p.add_argument("--budget-s", type=float, default=420.0, help="seconds for the whole run; cells that would not fit are "
                                                                 "skipped with reason 'time budget'")
    p.add_argument("--baseline-path", default=None, metavar="DIR",
                   help="a folder holding an older metaloom package, measured in a worker process")
    p.add_argument("--baseline-cases", default="greedy,s64", help="cases the baseline runs")
    p.add_argument("--static-cases", default="greedy,s64", help="cases transformers static (compiled on CUDA) runs")
    p.add_argument("--compile-s", type=float, default=90.0, help="estimated seconds of a first compiled call")
    p.add_argument("--compile-share", type=float, default=0.4, help="at most this fraction of the budget compiling")
    p.add_argument("--max-tokens", type=int, default=None, help="cap every case's tokens per sequence (tests)")
    p.add_argument("--seed", type=int, default=0, help="weights and sampling seed")
    p.add_argument("--spec-draft", type=int, default=4, metavar="K",
                   help="the spec case's drafts a step (n-gram drafter; a verify forward is K+1 tokens a row)")
    p.add_argument("--smoke", action="store_true",
                   help="compare token ids with METALOOM_CUDA_GRAPHS on and off instead (exit status 1 if they differ "
                        "in float32)")
    p.add_argument("--smoke-dtypes", default="float32,bfloat16", help="the dtypes --smoke compares in")


def main(args: argparse.Namespace) -> int:
    if args.smoke:
        result = smoke(args)
        print(json.dumps(result, indent=1) if args.json else "\n".join(
            f"{c['shape']} {c['dtype']} {c['case']}: {'equal' if c['equal'] else 'DIFFERENT'}" for c in result["checks"]))
        return 0 if result["ok"] else 1
    report = run(args)
    table = format_report(report)
    if args.json:
        print(json.dumps(report, indent=1))
        print(table, file=sys.stderr)
    else:
        print(table)
    return 0
