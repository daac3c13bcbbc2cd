"""`metaloom bench speculative`: every drafter against plain greedy, transformers' assisted
generation and llama.cpp, in one run on the same input-grounded prompts (code edits and a
summary, where the output quotes the input), plus the radix prefix cache's time to first token.

Each method decodes every prompt greedily up to ``--new-tokens`` tokens (end-of-sequence on,
so the task ends where the model ends it); metaloom's speculative methods emit exactly plain
greedy's tokens (asserted here too). Methods are interleaved within each repeat so drifting
machine load hits them alike; one warm-up pass, then medians over ``--repeats`` per prompt.
Reported: tokens, tok/s (prefill included, as a user waits for it), speedup over metaloom's
plain greedy, acceptance rate, mean accepted draft tokens per verification step, and tokens
per target forward. Peers: transformers ``generate`` plain, with ``prompt_lookup_num_tokens``,
and with ``assistant_model`` when ``--draft-model`` is given; llama.cpp through
``llama-cpp-python`` (plain and with its prompt-lookup draft) when installed, on the GGUF file
(llama.cpp runs the GGUF's own quantised weights, so its tokens differ; compare rates).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from metaloom.bench import model_args, single_weights
from metaloom.errors import InvalidParameter, MetaloomError
from metaloom.generator import LocalGenerator, Request
from metaloom.ledger import Ledger
from metaloom.models import LoadedModel, load
from metaloom.sampling import SamplingParams
from metaloom.speculative import Speculative
from metaloom.speculative.cost import measure_verify_cost
from metaloom.speculative.drafter import Drafter
from metaloom.speculative.planned import PlannedDrafter
from metaloom.speculative.registry import AUTO, DRAFTERS, DrafterOptions, auto_candidates, build_drafter, default_num_draft

CODE = '''import json
from dataclasses import dataclass


@dataclass
class Order:
    order_id: int
    customer: str
    items: list[str]
    total: float


def load_orders(path):
    """Read orders from a JSON file."""
    with open(path) as f:
        data = json.load(f)
    orders = []
    for record in data:
        orders.append(Order(record["order_id"], record["customer"], record["items"], record["total"]))
    return orders


def total_revenue(orders):
    """Sum the totals of all orders."""
    revenue = 0.0
    for order in orders:
        revenue += order.total
    return revenue
'''
TEXT = ("The city council met on Tuesday to discuss the new bicycle lanes on Main Street. Residents said the lanes "
        "made cycling safer, but several shop owners complained that the loss of parking hurt their business. "
        "The council agreed to count cyclists and parked cars for three months before deciding whether to keep "
        "the lanes, and asked the transport office to publish the counts every week.")
PROMPTS = (
    f"Rename the function `total_revenue` to `compute_revenue` in the following code. Output the complete "
    f"updated code and nothing else.\n\n```python\n{CODE}```",
    f"Add a docstring-preserving type hint `-> list[Order]` to `load_orders` in this code and output the whole "
    f"file.\n\n```python\n{CODE}```",
    f"Summarise this news text in two sentences, reusing its wording.\n\n{TEXT}",
)
# free generation: nothing in the prompt to copy, so the drafts come from the model's own text
FREE_PROMPTS = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a refrigerator keeps food cold, step by step, for a curious ten-year-old.",
    "Write a Python function that checks whether a string is a palindrome, with a short explanation.",
)
PROMPT_SETS = {"grounded": PROMPTS, "free": FREE_PROMPTS}


@dataclass
class Method:
    """One row of the table: ``run(prompt index)`` -> (tokens, ledger or None). ``planned``: the
    cost model of a metaloom method that has one (its choices go into the report)."""

    name: str
    run: Callable[[int], tuple[list[int], Ledger | None]]
    peer: bool = False
    times: dict[int, list[float]] = field(default_factory=dict)
    tokens: dict[int, list[int]] = field(default_factory=dict)
    ledgers: dict[int, Ledger] = field(default_factory=dict)
    planned: PlannedDrafter | None = None
    choices: dict[int, dict[str, Any]] = field(default_factory=dict)


def _metaloom(loaded: LoadedModel, name: str, speculative: Speculative | None, n: int,
              prompts: tuple[str, ...]) -> Method:
    gen = LocalGenerator(loaded, speculative=speculative)
    planned = speculative.drafter if speculative is not None and isinstance(speculative.drafter, PlannedDrafter) else None

    def run(i: int) -> tuple[list[int], Ledger]:
        ledger = Ledger()
        if planned is not None:  # every call learns from nothing, as a first request (or the CLI) does
            planned.reset()
        out = gen.generate([Request.chat(prompts[i], SamplingParams(temperature=0, max_tokens=n))], ledger=ledger)
        if planned is not None:
            method.choices[i] = planned.report()
        return list(out[0][0].token_ids), ledger

    method = Method(name, run, planned=planned)
    return method


def _drafter_methods(args: argparse.Namespace, loaded: LoadedModel, n: int, skipped: dict[str, str]) -> list[Method]:
    """One method per requested drafter, with the cost model (``--cost-model on``, the default),
    without (``off``, K tokens every step) or both; variants: quantized-int4 (4-bit self-draft),
    jacobi-lookup (Jacobi topped up by prompt lookup), auto (the cost model picks the drafter),
    and for the tree drafters NAME/W1.W2... (a static tree of those widths), NAME/chain (a chain
    of K as a tree) and NAME/dynamicN (DySpec's N-node tree); any entry may end in @K, its own
    draft tokens (tree nodes) a step. Unavailable ones land in ``skipped``. The cost model's
    verify cost is measured once for them all."""
    built: list[tuple[str, list[tuple[Drafter, int]]]] = []
    for entry in [d for d in args.drafters.split(",") if d]:
        got = _build_entry(args, loaded, entry, skipped)
        if got is not None:
            built.append(got)
    modes = {"on": (True,), "off": (False,), "both": (False, True)}[args.cost_model]
    cost = None
    if built and (True in modes or any(label == AUTO for label, _ in built)):
        cost = measure_verify_cost(loaded.model, most=1 + max(k for _, c in built for _, k in c))
    out = []
    prompts = PROMPT_SETS[args.prompts]
    for label, candidates in built:
        k = max(k for _, k in candidates)
        for planned in (True,) if label == AUTO else modes:
            if planned:
                spec = Speculative(PlannedDrafter(candidates, cost=cost, name=candidates[0][0].name if label != AUTO
                                                  else AUTO), k)
                name = f"metaloom {label} (K<={k}, cost model)"
            else:
                spec = Speculative(candidates[0][0], k)
                name = f"metaloom {label} (K={k})"
            out.append(_metaloom(loaded, name, spec, n, prompts))
    return out


def _build_entry(args: argparse.Namespace, loaded: LoadedModel, entry: str,
                 skipped: dict[str, str]) -> tuple[str, list[tuple[Drafter, int]]] | None:
    """(label, [(drafter, K)]) for one ``--drafters`` entry (auto: every candidate), or None
    with the reason in ``skipped``."""
    variants: dict[str, tuple[str, dict[str, Any]]] = {"quantized-int4": ("quantized", {"bits": 4}),
                                                       "jacobi-lookup": ("jacobi", {"jacobi_fill": "lookup"})}
    label, _, own_k = entry.partition("@")  # NAME@K: this drafter's own K (tree nodes for a tree)
    if own_k and not (own_k.isdigit() and 1 <= int(own_k) <= 64):
        skipped[entry] = "the K after @ must be a whole number in [1, 64]"
        return None
    if label == AUTO:
        candidates = auto_candidates(loaded, DrafterOptions(draft_model=args.draft_model))
        return label, [(d, min(k, int(own_k))) if own_k else (d, k) for d, k in candidates]
    base, extra = variants.get(label, (label, dict[str, Any]()))
    if "/" in label:  # a tree drafter with a shape: NAME/W1.W2..., NAME/chain, NAME/dynamicN
        name, shape = label.split("/", 1)
        base, extra = variants.get(name, (name, dict[str, Any]()))
        depth = int(own_k) if own_k else args.num_draft or DRAFTERS.get(base, DRAFTERS["recycling"]).num_draft
        tree = (f"dynamic:{shape.removeprefix('dynamic')}" if shape.startswith("dynamic")
                else "static:" + ",".join(["1"] * depth if shape == "chain" else shape.split(".")))
        extra = {**extra, "tree": tree}
    if base not in DRAFTERS:
        skipped[label] = f"unknown drafter (known: {sorted(DRAFTERS)} and {AUTO})"
        return None
    if base == "draft" and not args.draft_model:
        skipped[label] = "no --draft-model given (the default model has no smaller sibling with its tokenizer)"
        return None
    try:
        drafter = build_drafter(base, loaded, DrafterOptions(draft_model=args.draft_model, **extra))
    except Exception as exc:  # a drafter this model or build cannot have: report, keep benchmarking
        skipped[label] = f"{type(exc).__name__}: {exc}"
        return None
    k = int(own_k) if own_k else args.num_draft or default_num_draft(base, extra.get("tree"))
    return label, [(drafter, k)]


def _transformers_methods(args: argparse.Namespace, loaded: LoadedModel, n: int, skipped: dict[str, str]) -> list[Method]:
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
        from metaloom.models.load import default_model_path

        return default_model_path()
    return spec if spec.endswith(".gguf") and os.path.exists(spec) else None


def _llama_cpp_methods(args: argparse.Namespace, loaded: LoadedModel, n: int, skipped: dict[str, str]) -> list[Method]:
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
from metaloom.bench.speculative import llama_cpp_params
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
    "transformers": _transformers_methods, "llama.cpp": _llama_cpp_methods}


def _peers(args: argparse.Namespace) -> set[str]:
    peers = {p for p in args.peers.split(",") if p}
    if unknown := peers - set(PEERS):
        raise InvalidParameter("peers", sorted(unknown), f"a comma-separated subset of {list(PEERS)}")
    return peers


def prefix_cache_case(loaded: LoadedModel, prefix_tokens: int, repeats: int) -> dict[str, Any]:
    """Time to first token of a call sharing a ``prefix_tokens``-token prefix with an earlier
    call, without and with the radix prefix cache (`metaloom.bench.prefix`)."""
    from metaloom.bench.prefix import time_to_first_token

    return time_to_first_token(loaded, prefix_tokens, repeats=repeats)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """One report per dtype in ``--dtypes``; the prefix-cache case runs once, on the first."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    _peers(args)  # a bad --peers fails before any model loads
    reports: list[dict[str, Any]] = []
    for dtype in (d for d in args.dtypes.split(",") if d):
        reports.append(_one_dtype(args, dtype, reports))
    out: dict[str, Any] = {**_header(args), "runs": reports}
    if args.prefix_tokens > 0:
        loaded = load(args.model, dtype=reports[0]["dtype"], weights=single_weights(args))
        out["prefix_cache"] = prefix_cache_case(loaded, args.prefix_tokens, args.repeats)
    if args.out:
        write_json(args.out, out)
    return out


def _header(args: argparse.Namespace) -> dict[str, Any]:
    """What the figures depend on besides the methods: the CPU (its name, vector features and the
    kernels' instruction-set path), the threads, the weights asked for, the workload."""
    from metaloom.models.kernels import isa

    return {"cpu": isa.cpu_name(), "cpu_features": isa.describe(isa.cpu_features()), "isa": isa.chosen().name,
            "threads": torch.get_num_threads(), "weights": str(args.weights), "new_tokens": args.new_tokens,
            "prompts": len(PROMPT_SETS[args.prompts]), "prompt_set": args.prompts, "repeats": args.repeats}


def _one_dtype(args: argparse.Namespace, dtype: str, done: list[dict[str, Any]]) -> dict[str, Any]:
    loaded = load(args.model, dtype=dtype, weights=single_weights(args))
    n = args.new_tokens
    skipped: dict[str, str] = {}
    prompts = PROMPT_SETS[args.prompts]
    methods = [_metaloom(loaded, "metaloom greedy", None, n, prompts)]
    methods += _drafter_methods(args, loaded, n, skipped)
    peers = _peers(args)
    for peer, build in PEERS.items():
        if peer in peers:
            methods += build(args, loaded, n, skipped)
        else:
            skipped[peer] = "not asked for (--peers)"
    for m in list(methods):  # warm-up: first calls pay for allocations, thread pools, lazy imports
        try:
            for i in range(len(prompts)):
                m.run(i)
        except MetaloomError as exc:  # e.g. no speculator heads for this model: report, keep benchmarking
            skipped[m.name] = str(exc)
            methods.remove(m)
    for repeat in range(args.repeats):
        for m in methods:
            for i in range(len(prompts)):
                start = time.perf_counter()
                tokens, ledger = m.run(i)
                m.times.setdefault(i, []).append(time.perf_counter() - start)
                m.tokens.setdefault(i, tokens)
                if ledger is not None:
                    m.ledgers[i] = ledger
            # a long run that is stopped still leaves every row measured so far
            so_far = _report(loaded, [x for x in methods if x.times], skipped, dtype)
            row = so_far["methods"][-1]
            print(f"[{dtype} repeat {repeat + 1}/{args.repeats}] {m.name}: {row['tok_s']:.2f} tok/s "
                  f"({row['speedup']:.2f}x greedy)", file=sys.stderr, flush=True)
            if args.out:
                write_partial(args.out, args, done, so_far)
    return _report(loaded, methods, skipped, dtype)


def write_partial(path: str, args: argparse.Namespace, done: list[dict[str, Any]], current: dict[str, Any]) -> None:
    """``--out``: the report so far (finished dtypes, then the one being measured, marked
    ``partial``), replaced atomically after each method's measurement."""
    write_json(path, {**_header(args), "runs": [*done, {**current, "partial": True}], "partial": True})


def write_json(path: str, report: dict[str, Any]) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=1)
    os.replace(tmp, path)


def _report(loaded: LoadedModel, methods: list[Method], skipped: dict[str, str], dtype: str) -> dict[str, Any]:
    plain = methods[0]
    rows = []
    for m in methods:
        seconds = sum(statistics.median(t) for t in m.times.values())
        tokens = sum(len(t) for t in m.tokens.values())
        row: dict[str, Any] = {"method": m.name, "tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds}
        if not m.peer:
            row["same_tokens_as_greedy"] = all(m.tokens[i] == plain.tokens[i] for i in m.tokens)
            usage = [ledger.usage for ledger in m.ledgers.values()]
            drafted = sum(u.drafted_tokens for u in usage)
            accepted = sum(u.accepted_tokens for u in usage)
            steps = sum(u.verify_steps for u in usage)
            row["acceptance_rate"] = accepted / drafted if drafted else None
            row["accepted_per_step"] = accepted / steps if steps else None
            # target forwards: the prefill (first token) plus one per verification step
            row["tokens_per_forward"] = tokens / (steps + len(usage)) if steps else (1.0 if m is plain else None)
            if m.choices:
                row["cost_model"] = _choices(m.choices)
        rows.append(row)
    base = rows[0]["tok_s"]
    for row in rows:
        row["speedup"] = row["tok_s"] / base
    ours = [r for r in rows[1:] if "acceptance_rate" in r]
    best = max(ours, key=lambda r: r["tok_s"]) if ours else None
    ratios: dict[str, float] = {}
    if best is not None:
        for r in rows:
            if r["method"].startswith(("transformers", "llama.cpp")):
                ratios[f"{best['method']} / {r['method']}"] = best["tok_s"] / r["tok_s"]
    costs = [m.planned.cost.to_dict() for m in methods if m.planned is not None and m.planned.cost is not None]
    return {"model": loaded.name, "dtype": dtype, "weights": loaded.weights, "methods": rows,
            "verify_cost": costs[0] if costs else None,
            "best_drafter": best and best["method"],
            "ratios": ratios, "skipped": skipped}


def _choices(reports: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """What the cost model chose over a method's prompts (its last timed call of each): nodes
    verified per row-step, and per drafter the steps it drafted, the nodes verified and kept."""
    nodes: dict[str, int] = {}
    drafters: dict[str, dict[str, int]] = {}
    steps = 0
    for report in reports.values():
        steps += report["steps"]
        for k, v in report["nodes_verified"].items():
            nodes[k] = nodes.get(k, 0) + v
        for name, d in report["drafters"].items():
            total = drafters.setdefault(name, {"steps": 0, "verified": 0, "kept": 0})
            for key in total:
                total[key] += d[key]
    first = next(iter(reports.values()))
    return {"steps": steps, "nodes_verified": dict(sorted(nodes.items(), key=lambda kv: int(kv[0]))),
            "drafters": drafters, "scale": first["scale"], "per_prompt": [reports[i] for i in sorted(reports)]}


HELP = "every drafter against plain greedy, transformers' assisted generation and llama.cpp"


def add_args(p: argparse.ArgumentParser) -> None:
    model_args(p, dtypes="float32,bfloat16")
    p.set_defaults(weights="auto")  # what a user gets: the weights `load` picks for this model and machine
    for action in p._actions:
        if action.dest == "weights":
            action.help = "auto (default: what `load` picks on this machine, as a user gets) | native | dense"
    p.add_argument("--new-tokens", type=int, default=128, help="greedy tokens per prompt")
    p.add_argument("--drafters", default="auto,ngram,quantized,quantized-int4,jacobi,jacobi-lookup,heads,draft,"
                                         "recycling/chain,recycling",
                   help="drafters to compare, comma-separated")
    p.add_argument("--draft-model", default=None, help="draft model (same tokenizer) for the draft-model drafter")
    p.add_argument("--num-draft", type=int, default=None, help="draft tokens per step (default: each drafter's own)")
    p.add_argument("--cost-model", choices=("on", "off", "both"), default="on",
                   help="the speculation cost model on each drafter (on: it decides each step's draft length, 0 "
                        "included), off (K tokens every step), or both side by side; auto always has it")
    p.add_argument("--peers", default="transformers,llama.cpp",
                   help="peers to run beside metaloom, comma-separated ('' for none): transformers, llama.cpp")
    p.add_argument("--prompts", choices=sorted(PROMPT_SETS), default="grounded",
                   help="grounded: code edits and a summary that quote their input; free: open-ended generation")
    p.add_argument("--prefix-tokens", type=int, default=1000, help="shared prefix for the prefix-cache case (0: skip)")
    p.add_argument("--out", default=None,
                   help="write the JSON report here, rewritten after each method is measured (a stopped run keeps "
                        "its rows, marked partial)")

def main(args: argparse.Namespace) -> int:
    report = run(args)
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    kind = "input-grounded" if report.get("prompt_set", "grounded") == "grounded" else "free-generation"
    print(f"{report['prompts']} {kind} prompts, up to {report['new_tokens']} new tokens each, greedy; "
          f"{report['threads']} threads; median of {report['repeats']} after 1 warm-up")

    def fmt(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    for run_ in report["runs"]:
        print(f"\n{run_['model']} ({run_['dtype']})")
        print(f"{'method':<44} {'tokens':>6} {'tok/s':>7} {'speedup':>8} {'accept':>7} {'acc/step':>9} {'tok/fwd':>8}")
        for r in run_["methods"]:
            same = "" if r.get("same_tokens_as_greedy", True) else "  (tokens differ from greedy!)"
            print(f"{r['method']:<44} {r['tokens']:>6} {r['tok_s']:>7.1f} {r['speedup']:>7.2f}x "
                  f"{fmt(r.get('acceptance_rate'), '.0%'):>7} {fmt(r.get('accepted_per_step'), '.2f'):>9} "
                  f"{fmt(r.get('tokens_per_forward'), '.2f'):>8}{same}")
        for name, ratio in run_["ratios"].items():
            print(f"{name}: {ratio:.2f}x")
        for name, why in run_["skipped"].items():
            print(f"skipped {name}: {why}")
    if "prefix_cache" in report:
        p = report["prefix_cache"]
        print(f"prefix cache, {p['prefix_tokens']}-token shared prefix: time to first token {p['uncached_s'] * 1e3:.0f} ms "
              f"uncached vs {p['cached_s'] * 1e3:.0f} ms cached ({p['speedup']:.1f}x; {p['cached_tokens']:.0f} tokens cached)")
    return 0
