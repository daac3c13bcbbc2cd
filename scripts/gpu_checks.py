"""Device checks for the GPU engine (issue 35), run on a CUDA machine before the benchmark:

1. exactness in float32: greedy and seeded samples through `LocalGenerator` with the captured
   static step (METALOOM_CUDA_GRAPHS=on) against the eager step (off), token for token;
2. capture fidelity in bfloat16: a replayed graph against the same static step uncaptured, bit
   for bit, and greedy agreement of on/off in bfloat16 (different kernels: reported, not required);
3. where a batch-1 step's time goes: a bare forward loop, `LocalGenerator` greedy and seeded,
   eager and captured, and the host's busiest calls in the eager generate (torch.profiler).

Random-weight models built on the device (`random_model`), the default model's tokenizer from
``--tokenizer``. Prints a table; ``--out FILE`` writes the figures as JSON.
usage: python scripts/gpu_checks.py --tokenizer .gpu/tokenizer --out $OUT/checks.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import torch

from metaloom.generator.local import LocalGenerator
from metaloom.generator.types import Request, TokenIds
from metaloom.ledger import Ledger
from metaloom.models.engine.config import LlamaConfig
from metaloom.models.engine.graphs import StepGraphs
from metaloom.models.engine.llama import LlamaModel
from metaloom.models.engine.tokenizer import HFTokenizer
from metaloom.models.load import LoadedModel
from metaloom.sampling import SamplingParams

SHAPES = {
    "135m": {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
             "num_key_value_heads": 3, "tie_word_embeddings": True, "rope_theta": 100000.0},
    "1b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
           "num_key_value_heads": 8, "tie_word_embeddings": False, "rope_theta": 10000.0},
}
PROMPT = "Explain in detail how a bicycle works, part by part."
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU: a dry run of the script's plumbing
if DEVICE == "cpu":
    SHAPES = {name: {**cfg, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                     "num_attention_heads": 4, "num_key_value_heads": 2} for name, cfg in SHAPES.items()}


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def random_model(shape: str, vocab: int, dtype: torch.dtype, seed: int = 0) -> LlamaModel:
    """A Llama-family model of ``shape`` with N(0, 1/inputs) weights (unit gain: N(0, 0.02)
    makes every path repeat one token, which checks nothing), made on the device."""
    cfg = {"model_type": "llama", "vocab_size": vocab, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
           **SHAPES[shape]}
    config = LlamaConfig.from_hf(cfg)
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    d, inter, h, hk = config.hidden_size, config.intermediate_size, config.num_attention_heads, config.num_key_value_heads
    hd = d // h

    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(shape, generator=g, device=DEVICE) / shape[-1] ** 0.5).to(dtype)

    sd = {"model.embed_tokens.weight": w(vocab, d), "model.norm.weight": torch.ones(d, device=DEVICE, dtype=dtype)}
    if not config.tie_word_embeddings:
        sd["lm_head.weight"] = w(vocab, d)
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        sd.update({p + "self_attn.q_proj.weight": w(h * hd, d), p + "self_attn.k_proj.weight": w(hk * hd, d),
                   p + "self_attn.v_proj.weight": w(hk * hd, d), p + "self_attn.o_proj.weight": w(d, h * hd),
                   p + "mlp.gate_proj.weight": w(inter, d), p + "mlp.up_proj.weight": w(inter, d),
                   p + "mlp.down_proj.weight": w(d, inter),
                   p + "input_layernorm.weight": torch.ones(d, device=DEVICE, dtype=dtype),
                   p + "post_attention_layernorm.weight": torch.ones(d, device=DEVICE, dtype=dtype)})
    return LlamaModel.from_state_dict(config, sd, dtype=dtype, device=DEVICE)


def generator(model: LlamaModel, tok: HFTokenizer, folder: str) -> LocalGenerator:
    loaded = LoadedModel(model=model, tokenizer=tok, name="random", folder=folder, dtype=model.dtype)
    return LocalGenerator(loaded, prefill_overhead_tokens=32)


def run(gen: LocalGenerator, mode: str, requests: list[Request]) -> tuple[list[list[tuple[int, ...]]], float]:
    os.environ["METALOOM_CUDA_GRAPHS"] = mode
    sync()
    start = time.perf_counter()
    out = gen.generate(requests, ledger=Ledger())
    sync()
    return [[c.token_ids for c in o] for o in out], time.perf_counter() - start


def first_difference(a: list[tuple[int, ...]], b: list[tuple[int, ...]]) -> int | None:
    for x, y in zip(a, b, strict=True):
        for i, (u, v) in enumerate(zip(x, y, strict=False)):
            if u != v:
                return i
        if len(x) != len(y):
            return min(len(x), len(y))
    return None


def exactness(tok: HFTokenizer, folder: str, ids: list[int]) -> dict[str, Any]:
    """Float32 (135m shape): on and off give the same tokens."""
    model = random_model("135m", tok.vocab_size, torch.float32)
    gen = generator(model, tok, folder)
    greedy = [Request(TokenIds(tuple(ids)), SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))]
    seeded = [Request(TokenIds(tuple(ids)), SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=32,
                                                           ignore_eos=True)),
              Request(TokenIds(tuple(ids[:9])), SamplingParams(n=3, temperature=0.8, top_p=0.9, seed=2,
                                                               max_tokens=24, ignore_eos=True))]
    out: dict[str, Any] = {}
    for name, requests in (("greedy", greedy), ("seeded", seeded)):
        off, _ = run(gen, "off", requests)
        on, _ = run(gen, "on", requests)
        out[f"float32_{name}_equal"] = off == on
        out[f"float32_{name}_first_difference"] = first_difference([t for o in off for t in o], [t for o in on for t in o])
    runner = next(iter(model._graphs.values()))  # made by the "on" runs
    out["float32_captures"], out["float32_replays"], out["capture_failure"] = runner.captures, runner.replays, runner.failure
    del gen, model
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return out


def fidelity(model: LlamaModel, ids: list[int], steps: int = 24) -> dict[str, Any]:
    """A replayed graph against the same step uncaptured, from one prefill, bfloat16."""
    pool = model.new_pool(slots=4096)
    cache = model.new_cache(4, 512, pool)
    prompt = torch.tensor([ids] * 4, device=DEVICE)
    logits = model.forward(prompt, cache)[:, -1]
    other = cache.fork([0, 1, 2, 3])
    captured, plain = StepGraphs(model, pool, capture=DEVICE == "cuda"), StepGraphs(model, pool, capture=False)
    nxt = logits.argmax(-1)
    worst, equal = 0.0, True
    for _ in range(steps):
        a, _ = captured.run(nxt, cache, [1] * 4)
        b, _ = plain.run(nxt, other, [1] * 4)
        equal &= bool(torch.equal(a, b))
        worst = max(worst, float((a.float() - b.float()).abs().max()))
        nxt = a.argmax(-1)
    cache.release()
    other.release()
    return {"bf16_graph_vs_uncaptured_bitwise": equal, "bf16_graph_vs_uncaptured_max_abs": worst,
            "captures": captured.captures, "replays": captured.replays}


def step_times(gen: LocalGenerator, model: LlamaModel, ids: list[int], tokens: int = 128) -> dict[str, Any]:
    """Milliseconds per batch-1 step: a bare forward loop, and generate (greedy, seeded)."""
    out: dict[str, Any] = {}
    for mode in ("off", "on"):
        os.environ["METALOOM_CUDA_GRAPHS"] = mode
        for _ in range(2):  # the second is timed (the first captures)
            pool = model.new_pool(slots=1024)
            cache = model.new_cache(1, len(ids) + tokens + 1, pool)
            nxt = model.forward(torch.tensor([ids], device=DEVICE), cache)[:, -1].argmax(-1)
            sync()
            start = time.perf_counter()
            for _ in range(tokens):
                nxt = model.forward(nxt[:, None], cache)[:, -1].argmax(-1)
            sync()
            bare = (time.perf_counter() - start) / tokens * 1e3
            cache.release()
        out[f"bare_forward_ms_{mode}"] = bare
        for name, params in (("greedy", SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)),
                             ("seeded", SamplingParams(temperature=1.0, seed=1, max_tokens=tokens, ignore_eos=True))):
            request = [Request(TokenIds(tuple(ids)), params)]
            run(gen, mode, request)
            _, seconds = run(gen, mode, request)
            out[f"generate_{name}_ms_{mode}"] = seconds / tokens * 1e3
    return out


def host_profile(gen: LocalGenerator, ids: list[int], mode: str, tokens: int = 32) -> list[dict[str, Any]]:
    """The host's busiest calls in one batch-1 seeded generate (self CPU time per step)."""
    from torch.profiler import ProfilerActivity, profile

    request = [Request(TokenIds(tuple(ids)), SamplingParams(temperature=1.0, seed=3, max_tokens=tokens,
                                                            ignore_eos=True))]
    run(gen, mode, request)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run(gen, mode, request)
    rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:12]
    return [{"op": e.key, "calls_per_step": e.count / tokens, "self_cpu_ms_per_step": e.self_cpu_time_total / 1e3 / tokens,
             "device_ms_per_step": getattr(e, "self_device_time_total", 0) / 1e3 / tokens} for e in rows]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--out")
    args = p.parse_args()
    tok = HFTokenizer(args.tokenizer)
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": PROMPT}]), add_special_tokens=False)
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (dry run, tiny shapes)"
    report: dict[str, Any] = {"device": name, "torch": torch.__version__}
    report.update(exactness(tok, args.tokenizer, ids))
    print({k: v for k, v in report.items()}, flush=True)
    model = random_model("1b", tok.vocab_size, torch.bfloat16)
    report.update(fidelity(model, ids))
    gen = generator(model, tok, args.tokenizer)
    greedy = [Request(TokenIds(tuple(ids)), SamplingParams(temperature=0, max_tokens=128, ignore_eos=True))]
    off, _ = run(gen, "off", greedy)
    on, _ = run(gen, "on", greedy)
    report["bf16_1b_greedy_first_difference"] = first_difference(off[0], on[0])
    report.update(step_times(gen, model, ids))
    print({k: v for k, v in report.items()}, flush=True)
    report["host_profile_off"] = host_profile(gen, ids, "off")
    report["host_profile_on"] = host_profile(gen, ids, "on")
    for mode in ("off", "on"):
        print(f"-- busiest host calls per batch-1 seeded step, graphs {mode}")
        for r in report[f"host_profile_{mode}"]:
            print(f"  {r['op'][:48]:48s} {r['calls_per_step']:6.1f} calls {r['self_cpu_ms_per_step']:8.3f} ms host "
                  f"{r['device_ms_per_step']:8.3f} ms device")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    print("checks:", json.dumps({k: v for k, v in report.items() if not k.startswith("host_profile")}), flush=True)


if __name__ == "__main__":
    main()
