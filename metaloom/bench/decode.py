"""`metaloom bench decode`: metaloom's decoding against transformers, llama.cpp and vLLM on the
same model, each system in its own process (`metaloom.bench.peers`).

Systems (rows): metaloom with ``--weights native`` (the GGUF's quantised blocks, in the first
of ``--dtypes``) and/or ``dense`` (dequantised, once per dtype); transformers ``generate`` once
per dtype; llama.cpp (llama-cpp-python from ``--llama-cpp VENV``, on the GGUF file itself) and
vLLM (``--vllm VENV``, bfloat16, on the converted transformers folder) when ``--peers`` names
them (default: transformers only). All get the same thread count and the same prompt token ids.

Kernel paths: ``--isa avx2,avx512`` runs each metaloom row once per instruction-set path
(``METALOOM_ISA``, `metaloom.models.kernels.isa`), with PyTorch's, oneDNN's and MKL's own dispatch capped
at the same instruction set (`metaloom.models.kernels.isa.library_env`), so an AVX-512 machine measures
what an AVX2 user gets; ``--llama-cpp-avx2 VENV`` adds llama.cpp built for AVX2 alone. Every row
says which path its kernels ran.

Cases: (1) batch-1 greedy, ``--new-tokens`` tokens from the chat-templated GREEDY_PROMPT;
(2) ``--samples`` samples x ``--sample-tokens`` tokens from one ~300-token prompt at
temperature 1, plain sampling (no top-k/top-p), the prompt prefilled once and shared by the
samples (llama.cpp: its low-level batch API, every prompt token in all sequences). End of
sequence is ignored so every system generates exactly as many tokens; a different count is an
error in the report. Medians (with min-max) of ``--repeats`` alternating rounds after one
warm-up; tokens/s and ratios against llama.cpp and metaloom dense float32; for batch-1 greedy of
each metaloom configuration, the bandwidth achieved reading its weights once per token against
the copy bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Any

from metaloom.bench import model_args, names
from metaloom.bench.peers import SystemRun, SystemSpec, measure

GREEDY_PROMPT = "Explain in detail how a bicycle works, part by part."
LONG_PROMPT = (
    "Read the following notes and then write a short story that uses all of them.\n"
    + "\n".join(f"Note {i}: the lighthouse keeper counted {i * 7} ships passing the northern rocks before dawn, "
                "and each one carried a different flag." for i in range(1, 13))
)
PEERS = ("transformers", "llama.cpp", "vllm")
WEIGHTS = ("native", "native-q8", "dense")
DEFAULT_PEERS = "transformers"
LINEAR = ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight",
          "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")
REFERENCES = {"llama.cpp": "llama.cpp", "metaloom_float32": "metaloom dense float32"}  # row names, or their first words


def options(args: argparse.Namespace) -> tuple[list[str], list[str], list[str]]:
    """(dtypes, weight modes, peers) from the arguments; a bad name raises before anything loads."""
    from metaloom.models.load import DTYPES

    dtypes = names("dtypes", args.dtypes, tuple(DTYPES)) or ["float32"]
    weights = names("weights", args.weights, WEIGHTS)
    peers = names("peers", args.peers, PEERS)
    return dtypes, weights, peers


def isa_paths(args: argparse.Namespace) -> list[str | None]:
    """The kernel paths to run metaloom on (None: the process's own choice); a name that is no
    path, or one this CPU lacks, is an `UnsupportedISA` before anything loads."""
    from metaloom.models.kernels import isa

    paths = names("isa", args.isa or "", isa.NAMES)
    for name in paths:
        isa.resolve(name)
    return list(paths) or [None]


def gguf_file(spec: str) -> str | None:
    """The GGUF behind a model spec (the default model's, or the file named), else None."""
    if spec in ("", "default"):
        from metaloom.models.find import default_model_path

        return default_model_path()
    if os.path.isfile(spec):
        with open(spec, "rb") as f:
            return spec if f.read(4) == b"GGUF" else None
    return None


def gguf_weight_bytes(path: str, kept: frozenset[int] | None = None) -> tuple[int, str]:
    """(bytes of weights one batch-1 decode step reads with native weights: every linear layer
    plus the output head, which is the embedding when tied, at the file's quantised size, or
    at float32's when its ggml type is not in ``kept`` (native dequantises those); the file's
    quantisation, e.g. ``Q4_1``)."""
    import gguf

    reader = gguf.GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}

    def size(t: Any) -> int:
        return int(t.n_bytes) if kept is None or int(t.tensor_type) in kept else 4 * int(t.n_elements)

    linear = sum(size(t) for name, t in tensors.items() if name.startswith("blk.") and name.split(".", 2)[2] in LINEAR)
    head = tensors.get("output.weight") or tensors["token_embd.weight"]
    field = reader.fields.get("general.file_type")
    try:
        quant = gguf.LlamaFileType(int(field.contents())).name.removeprefix("MOSTLY_") if field else "GGUF"
    except ValueError:
        quant = "GGUF"
    return linear + size(head), quant


def _kept_types() -> frozenset[int] | None:
    """The ggml types native weights keep quantised (None: not known in this build)."""
    try:
        from metaloom.models.engine.native import kept_types

        return kept_types()
    except ImportError:
        return None


def cases(args: argparse.Namespace, folder: str) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """The workers' case specs (same prompt token ids for every system) and their labels."""
    from metaloom.models.engine.tokenizer import HFTokenizer

    tok = HFTokenizer(folder)
    greedy_ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": GREEDY_PROMPT}]), add_special_tokens=False)
    long_ids = tok.encode(LONG_PROMPT)
    specs = {"greedy": {"prompt_ids": list(greedy_ids), "n": 1, "max_tokens": args.new_tokens, "temperature": 0.0, "seed": 0},
             "samples": {"prompt_ids": list(long_ids), "n": args.samples, "max_tokens": args.sample_tokens,
                         "temperature": 1.0, "seed": 0}}
    labels = {"greedy": f"batch-1 greedy, {args.new_tokens} tokens, {len(greedy_ids)}-token chat prompt",
              "samples": f"{args.samples} samples x {args.sample_tokens} tokens, {len(long_ids)}-token prompt, temperature 1"}
    return specs, labels


def _venv_python(venv: str) -> str:
    return os.path.join(venv, "bin", "python")


def systems(args: argparse.Namespace, folder: str, gguf: str | None, quant: str, threads: int,
            ) -> tuple[list[SystemSpec], dict[str, str]]:
    """The configurations to run, and {name: reason} for those that cannot be set up."""
    import importlib.util

    import metaloom
    from metaloom.models.kernels import isa

    dtypes, weights, peers = options(args)
    skipped: dict[str, str] = {}
    root = os.path.dirname(os.path.dirname(os.path.abspath(metaloom.__file__)))
    ours = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    common = {"model": args.model, "device": None if args.device == "auto" else args.device}
    out: list[SystemSpec] = []
    for path in isa_paths(args):
        env, tag = (ours, "") if path is None else (ours | {isa.ENV: path} | isa.library_env(path), f" [{path}]")
        if "native" in weights:
            out.append(SystemSpec(f"metaloom native {dtypes[0]}{tag}", "metaloom", sys.executable,
                                  common | {"dtype": dtypes[0], "weights": "native"}, env))
        if "native-q8" in weights:  # int8 activations, integer products: llama.cpp's own arithmetic
            out.append(SystemSpec(f"metaloom native-q8 {dtypes[0]}{tag}", "metaloom", sys.executable,
                                  common | {"dtype": dtypes[0], "weights": "native", "activations": "q8"}, env))
        if "dense" in weights:
            out += [SystemSpec(f"metaloom dense {d}{tag}", "metaloom", sys.executable,
                               common | {"dtype": d, "weights": "dense"}, env) for d in dtypes]
    if "transformers" in peers:
        out += [SystemSpec(f"transformers {d}", "transformers", sys.executable,
                           {"folder": folder, "dtype": d, "device": common["device"]}, ours) for d in dtypes]
    if "llama.cpp" in peers:
        python = _venv_python(args.llama_cpp) if getattr(args, "llama_cpp", None) else sys.executable
        if gguf is None:
            skipped["llama.cpp"] = f"{args.model!r} is not a GGUF file (llama.cpp runs the GGUF itself)"
        elif python == sys.executable and importlib.util.find_spec("llama_cpp") is None:
            skipped["llama.cpp"] = "no --llama-cpp VENV given and this interpreter has no llama_cpp"
        else:
            builds = [(f"llama.cpp {quant}", python)]
            if getattr(args, "llama_cpp_avx2", None):
                builds.append((f"llama.cpp {quant} [avx2 build]", _venv_python(args.llama_cpp_avx2)))
            env = dict(os.environ)
            config = {"gguf": gguf, "extra_buffers": True}
            for label, py in builds:
                plain = SystemSpec(label, "llama.cpp", py, config | {"extra_buffers": False}, env)
                out.append(SystemSpec(label, "llama.cpp", py, config, env, fallback=plain,
                                      fallback_note="its extra buffer types (AMX, repacked weights) crashed here; "
                                                    "run without"))
    if "vllm" in peers:
        if not getattr(args, "vllm", None):
            skipped["vllm"] = "no --vllm VENV given"
        else:
            out.append(SystemSpec("vllm bfloat16", "vllm", _venv_python(args.vllm), {"folder": folder, "dtype": "bfloat16"},
                                  _vllm_env(args.vllm, threads)))
    return out, skipped


def _vllm_env(venv: str, threads: int) -> dict[str, str]:
    """vLLM's CPU environment as `metaloom bench serve` starts it, bound to ``threads`` CPUs."""
    import glob

    from metaloom.bench.servers import _TCMALLOC, vllm_env

    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    tcmalloc = [*_TCMALLOC, *sorted(glob.glob("/usr/lib/*/libtcmalloc_minimal.so.4"))]
    return vllm_env(venv, {**os.environ, "HF_HUB_OFFLINE": "1"}, cpus[:threads], tcmalloc=tcmalloc)


def summarise(runs: list[SystemRun], specs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Per system and case: median, min and max seconds, tok/s, ratios against the references
    (this system's tok/s over theirs), or the error."""
    rows: list[dict[str, Any]] = []
    for run in runs:
        results: dict[str, Any] = {}
        for case, out in run.outcomes.items():
            r: dict[str, Any] = {"error": out.error, "tokens": out.tokens, "seconds": out.seconds}
            if out.error is None and out.seconds and out.tokens:
                med = statistics.median(out.seconds)
                r |= {"median_s": med, "min_s": min(out.seconds), "max_s": max(out.seconds), "tok_s": out.tokens / med,
                      "tok_s_min": out.tokens / max(out.seconds), "tok_s_max": out.tokens / min(out.seconds)}
            results[case] = r
        rows.append({"name": run.spec.name, "system": run.spec.system, "config": dict(run.spec.config), "info": run.info,
                     "note": run.note, "results": results})
    for case in specs:
        speed = {key: next((row["results"][case].get("tok_s") for row in rows
                            if row["name"] == ref or row["name"].startswith(ref + " ")), None)
                 for key, ref in REFERENCES.items()}
        for row in rows:
            r = row["results"][case]
            r["ratios"] = {key: (r["tok_s"] / speed[key] if r.get("tok_s") and speed[key] else None) for key in REFERENCES}
    return rows


def bandwidth(rows: list[dict[str, Any]], native_bytes: int | None, copy_gbs: float) -> dict[str, dict[str, Any]]:
    """Weights read per second by batch-1 greedy of each metaloom configuration (those with a
    weights mode): native reads the GGUF's quantised bytes per token, dense params x itemsize."""
    out = {}
    for row in rows:
        if (mode := row["config"].get("weights")) is None:
            continue
        per_token = native_bytes if mode == "native" else row["info"].get("dense_weight_bytes")
        g = row["results"]["greedy"]
        gbs = per_token * g["tokens"] / g["median_s"] / 1e9 if per_token and g.get("median_s") else None
        out[row["name"]] = {"weight_bytes_per_token": per_token, "gb_s": gbs,
                            "fraction_of_copy_bandwidth": gbs / copy_gbs if gbs else None,
                            "step_path": row["info"].get("step_path"), "isa": row["info"].get("isa")}
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from metaloom.bench.timing import copy_bandwidth_gbs
    from metaloom.models.find import resolve
    from metaloom.models.kernels import isa
    from metaloom.models.load import pick_device

    options(args)  # bad names fail before anything loads
    isa_paths(args)
    name, folder = resolve(args.model)
    gguf = gguf_file(args.model)
    native_bytes, quant = gguf_weight_bytes(gguf, _kept_types()) if gguf else (None, "")
    device = pick_device(args.device)
    threads = torch.get_num_threads()
    load_before = os.getloadavg()
    copy_gbs = copy_bandwidth_gbs(device=device)
    specs, labels = cases(args, folder)
    configs, skipped = systems(args, folder, gguf, quant, threads)
    runs, failed = measure(configs, specs, repeats=args.repeats, threads=threads,
                           log=lambda s: print(s, file=sys.stderr, flush=True))
    rows = summarise(runs, specs)
    return {
        "model": name, "gguf": gguf, "gguf_quantisation": quant or None,
        "machine": {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "threads": threads,
                    "cpu": isa.cpu_name(), "cpu_features": isa.describe(isa.cpu_features()), "isa_paths": isa.runnable(),
                    "copy_bandwidth_gb_s": copy_gbs, "load_average_before": load_before,
                    "load_average_after": os.getloadavg()},
        "repeats": args.repeats, "warmup": 1,
        "cases": {c: {"label": labels[c], "prompt_tokens": len(s["prompt_ids"]), "sequences": s["n"],
                      "tokens_per_sequence": s["max_tokens"], "expected_tokens": s["n"] * s["max_tokens"],
                      "temperature": s["temperature"]} for c, s in specs.items()},
        "systems": rows, "skipped": skipped | failed,
        "achieved_weight_bandwidth": bandwidth(rows, native_bytes, copy_gbs),
    }


def _f(x: float | None, spec: str, suffix: str = "") -> str:
    return "-" if x is None else format(x, spec) + suffix


def format_report(report: dict[str, Any]) -> str:
    m = report["machine"]
    cpu = f" ({m['cpu']}: {m['cpu_features']}; kernel paths {', '.join(m['isa_paths'])})" if m.get("cpu") else ""
    lines = [f"{report['model']} ({report['gguf_quantisation'] or 'transformers folder'}) on {m['device']}{cpu}: "
             f"{m['threads']} threads; copy bandwidth {m['copy_bandwidth_gb_s']:.1f} GB/s; load average "
             f"{m['load_average_before'][0]:.2f} before, {m['load_average_after'][0]:.2f} after; "
             f"median (min-max) of {report['repeats']} alternating rounds after 1 warm-up"]
    wide = max([28, *(len(row["name"]) + 1 for row in report["systems"])])
    for case, c in report["cases"].items():
        lines += ["", c["label"],
                  f"{'system':<{wide}} {'tok/s':>8} {'(min-max)':>15} {'median s':>9} {'vs llama.cpp':>13} {'vs ml f32':>10}"]
        for row in report["systems"]:
            r = row["results"][case]
            if r.get("error"):
                lines.append(f"{row['name']:<{wide}} error: {r['error']}")
                continue
            span = f"({_f(r.get('tok_s_min'), '.1f')}-{_f(r.get('tok_s_max'), '.1f')})"
            ratios = r["ratios"]
            lines.append(f"{row['name']:<{wide}} {_f(r.get('tok_s'), '8.1f')} {span:>15} {_f(r.get('median_s'), '9.3f')} "
                         f"{_f(ratios['llama.cpp'], '12.2f', 'x'):>13} {_f(ratios['metaloom_float32'], '9.2f', 'x'):>10}")
    if report["achieved_weight_bandwidth"]:
        lines.append("")
    for name, b in report["achieved_weight_bandwidth"].items():
        if b["gb_s"] is None:
            continue
        lines.append(f"{name}: batch-1 greedy reads {b['weight_bytes_per_token'] / 1e6:.1f} MB of weights per token at "
                     f"{b['gb_s']:.1f} GB/s = {100 * b['fraction_of_copy_bandwidth']:.0f}% of copy bandwidth; "
                     f"one-token steps: {b['step_path']}" + (f"; kernel path {b['isa']}" if b.get("isa") else ""))
    for row in report["systems"]:
        if row["system"] != "metaloom" and row["info"]:
            lines.append(f"{row['name']}: " + ", ".join(f"{k} {v}" for k, v in row["info"].items()))
        if row["note"]:
            lines.append(f"{row['name']}: {row['note']}")
    lines += [f"skipped {name}: {why}" for name, why in report["skipped"].items()]
    return "\n".join(lines)


HELP = "metaloom's decoding against transformers, llama.cpp and vLLM on the same model"


def add_args(p: argparse.ArgumentParser) -> None:
    model_args(p, device=True, dtypes="float32,bfloat16", weights=False)
    p.add_argument("--weights", default="dense",
                   help="metaloom weight modes, comma-separated: native (the GGUF's quantised blocks, in the first of "
                        "--dtypes), native-q8 (the same with --activations q8: int8 activations, integer products, "
                        "as llama.cpp multiplies), dense (dequantised, once per --dtypes entry)")
    p.add_argument("--new-tokens", type=int, default=128, help="batch-1 greedy length")
    p.add_argument("--samples", type=int, default=16, help="samples in the n-samples case")
    p.add_argument("--sample-tokens", type=int, default=64, help="tokens per sample in the n-samples case")
    p.add_argument("--peers", default=DEFAULT_PEERS,
                   help=f"peers to run beside metaloom, comma-separated ('' for none) of {', '.join(PEERS)}")
    p.add_argument("--llama-cpp", default=None, metavar="VENV",
                   help="llama-cpp-python's venv for --peers llama.cpp (default: this interpreter's)")
    p.add_argument("--llama-cpp-avx2", default=None, metavar="VENV",
                   help="a second llama-cpp-python venv built for AVX2 alone (GGML_NATIVE=OFF, GGML_AVX512=OFF), run "
                        "beside the first with --peers llama.cpp: what an AVX2 user gets, on an AVX-512 machine")
    p.add_argument("--isa", default="", metavar="PATHS",
                   help="run metaloom once per kernel path, comma-separated (avx512, avx2, neon, generic: METALOOM_ISA, "
                        "with PyTorch's, oneDNN's and MKL's own capped alike); default: the best this CPU has")
    p.add_argument("--vllm", default=None, metavar="VENV", help="a vLLM venv to run beside metaloom (default: none)")

def main(args: argparse.Namespace) -> int:
    report = run(args)
    print(json.dumps(report, indent=1) if args.json else format_report(report))
    return 0
