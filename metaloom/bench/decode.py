"""`metaloom bench decode`: metaloom against transformers `generate` on the same weights and
dtype, in one run.

Cases: (1) batch-1 greedy, ``--new-tokens`` tokens, end-of-sequence ignored so both sides
generate exactly as many; (2) ``--samples`` samples from one ~300-token prompt (transformers:
``num_return_sequences``; metaloom: prefill once, fork the cache). The two sides alternate
within each repeat (`paired_median_seconds`) so drifting load on a shared machine hits both
alike. Reports tokens/s, the ratio, and for case 1 the bandwidth achieved reading the weights
once per token against the machine's copy bandwidth measured here.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, dataclass

import torch

from metaloom.bench.timing import copy_bandwidth_gbs, paired_median_seconds
from metaloom.generator import LocalGenerator, Request
from metaloom.ledger import Ledger
from metaloom.models import load
from metaloom.models.fused import step_path
from metaloom.models.load import pick_device
from metaloom.sampling import SamplingParams

GREEDY_PROMPT = "Explain in detail how a bicycle works, part by part."
LONG_PROMPT = (
    "Read the following notes and then write a short story that uses all of them.\n"
    + "\n".join(f"Note {i}: the lighthouse keeper counted {i * 7} ships passing the northern rocks before dawn, "
                "and each one carried a different flag." for i in range(1, 13))
)


@dataclass(frozen=True)
class CaseResult:
    dtype: str
    case: str
    new_tokens: int
    metaloom_s: float
    transformers_s: float

    @property
    def metaloom_tok_s(self) -> float:
        return self.new_tokens / self.metaloom_s

    @property
    def transformers_tok_s(self) -> float:
        return self.new_tokens / self.transformers_s

    @property
    def speedup(self) -> float:
        return self.transformers_s / self.metaloom_s


def _hf_model(folder: str, dtype: torch.dtype, device: torch.device):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    return model.to(device).eval()  # type: ignore[arg-type]  # transformers' stubs type .to() narrowly


def _one_dtype(args: argparse.Namespace, dtype: str) -> tuple[list[CaseResult], float, str]:
    """Both cases for one dtype; returns the results, the achieved weight bandwidth (GB/s) and
    how metaloom's model took its one-token steps (`metaloom.models.fused.step_path`)."""
    loaded = load(args.model, dtype=dtype, device=args.device)
    device = loaded.model.device
    gen = LocalGenerator(loaded)
    hf = _hf_model(loaded.folder, loaded.dtype, device)
    tok = loaded.tokenizer
    results = []

    # case 1: batch-1 greedy
    messages = ({"role": "user", "content": GREEDY_PROMPT},)
    n = args.new_tokens
    greedy = Request(messages, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    ids = torch.tensor([tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)], device=device)

    def theirs_greedy() -> object:
        with torch.inference_mode():
            return hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                               do_sample=False, pad_token_id=0)

    ours, theirs = paired_median_seconds([lambda: gen.generate([greedy], ledger=Ledger()), theirs_greedy],
                                         args.repeats, device=device)
    results.append(CaseResult(dtype, "batch-1 greedy", n, ours, theirs))
    weight_bytes = loaded.model.num_parameters() * loaded.dtype.itemsize  # type: ignore[attr-defined]

    # case 2: k samples from one long prompt
    k, m = args.samples, args.sample_tokens
    sample = Request(LONG_PROMPT, SamplingParams(temperature=1.0, n=k, max_tokens=m, ignore_eos=True, seed=0))
    long_ids = torch.tensor([tok.encode(LONG_PROMPT)], device=device)

    def theirs_samples() -> object:
        with torch.inference_mode():
            return hf.generate(long_ids, attention_mask=torch.ones_like(long_ids), max_new_tokens=m, min_new_tokens=m,
                               do_sample=True, top_k=0, top_p=1.0, temperature=1.0, num_return_sequences=k,
                               pad_token_id=0)

    ours_k, theirs_k = paired_median_seconds([lambda: gen.generate([sample], ledger=Ledger()), theirs_samples],
                                             args.repeats, device=device)
    results.append(CaseResult(dtype, f"{k} samples, {long_ids.shape[1]}-token prompt", k * m, ours_k, theirs_k))
    return results, weight_bytes * n / ours / 1e9, step_path(loaded.model)


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def run(args: argparse.Namespace) -> dict:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    device = pick_device(args.device)
    bandwidth = copy_bandwidth_gbs(device=device)
    results: list[CaseResult] = []
    achieved: dict[str, float] = {}
    steps: dict[str, str] = {}
    for dtype in args.dtypes.split(","):
        cases, achieved[dtype], steps[dtype] = _one_dtype(args, dtype)
        results.extend(cases)
    return {
        "machine": {"device": _device_name(device), "threads": torch.get_num_threads(), "copy_bandwidth_gb_s": bandwidth},
        "cases": [asdict(r) | {"metaloom_tok_s": r.metaloom_tok_s, "transformers_tok_s": r.transformers_tok_s,
                               "speedup": r.speedup} for r in results],
        "achieved_weight_bandwidth_gb_s": achieved,
        "decode_steps": steps,
        "repeats": args.repeats,
    }


def main(args: argparse.Namespace) -> int:
    report = run(args)
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    bw = report["machine"]["copy_bandwidth_gb_s"]
    print(f"{report['machine']['device']}: measured copy bandwidth {bw:.1f} GB/s; {report['machine']['threads']} CPU threads; "
          f"median of {report['repeats']} after 1 warm-up")
    print(f"{'dtype':<9} {'case':<34} {'metaloom tok/s':>15} {'transformers tok/s':>19} {'ratio':>7}")
    for c in report["cases"]:
        print(f"{c['dtype']:<9} {c['case']:<34} {c['metaloom_tok_s']:>15.1f} "
              f"{c['transformers_tok_s']:>19.1f} {c['speedup']:>6.2f}x")
    for dtype, gbs in report["achieved_weight_bandwidth_gb_s"].items():
        print(f"{dtype}: batch-1 greedy reads the weights at {gbs:.1f} GB/s "
              f"= {100 * gbs / bw:.0f}% of measured copy bandwidth; one-token steps: {report['decode_steps'][dtype]}")
    return 0
