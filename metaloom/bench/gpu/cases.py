"""What `metaloom bench gpu` measures: the cases (prompt, samples, lengths, speculation) and the
systems, each a row of the report (see the package docstring for what each one is)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


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
TRANSFORMERS = ("tf-eager", "tf-static")


def graphs_rows() -> int:
    """The most rows the ``graphs`` row's step runs with Triton's kernels (``graphs-mixed`` differs
    from ``graphs`` only above it)."""
    from metaloom.models.engine.graphs import triton_rows

    return triton_rows()


def transformers_compiles(device: str) -> bool:
    """Whether ``generate`` with a static cache compiles the model on ``device`` (transformers
    compiles on CUDA, not on the CPU)."""
    return device.startswith("cuda")


# the speculative case's passage, which its prompt asks to copy (the drafter copies from the prompt)
PASSAGE = ("The city council met on Tuesday to discuss the new bicycle lanes on Main Street. Residents said the lanes "
           "made cycling safer, but several shop owners complained that the loss of parking hurt their business. "
           "The council agreed to count cyclists and parked cars for three months before deciding whether to keep "
           "the lanes, and asked the transport office to publish the counts every week.")
COPY_PROMPT = f"Copy the following passage exactly, word for word, twice.\n\n{PASSAGE}"


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
