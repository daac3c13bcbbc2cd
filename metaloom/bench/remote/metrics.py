"""What the vLLM server counted, from its Prometheus counters (``/metrics``): read once they stop
moving, and the growth of each counter between two readings, set beside what a system charged."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Mapping

# usage field charged -> the vLLM counter that counts the same thing
COUNTERS = {"generation": "vllm:generation_tokens_total", "prompt": "vllm:prompt_tokens_total",
            "cached": "vllm:prompt_tokens_cached_total", "requests": "vllm:request_success_total"}


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text exposition -> {metric name: value summed over its label sets}. Comment
    lines and unreadable values are skipped; a trailing timestamp is ignored."""
    out: dict[str, float] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if "{" in line:
            name, rest = line[:line.index("{")], line[line.rindex("}") + 1:]
        else:
            name, _, rest = line.partition(" ")
        fields = rest.split()
        if not name or not fields:
            continue
        try:
            value = float(fields[0])
        except ValueError:
            continue
        out[name] = out.get(name, 0.0) + value
    return out


def counter_deltas(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, int]:
    """What each of `COUNTERS` grew by between two readings."""
    return {key: round(after.get(name, 0.0) - before.get(name, 0.0)) for key, name in COUNTERS.items()}



def read_metrics(base_url: str, settle_s: float = 2.0) -> dict[str, float]:
    """The server's counters once they stop moving: vLLM records an engine step's figures just
    after sending its outputs, so a reading right after an answer can miss the last step."""
    root = base_url.removesuffix("/v1").rstrip("/")
    last: dict[str, float] | None = None
    deadline = time.monotonic() + settle_s
    while True:
        with urllib.request.urlopen(f"{root}/metrics", timeout=10) as r:
            now = parse_metrics(r.read().decode("utf-8", "replace"))
        if last is not None and all(now.get(n) == last.get(n) for n in COUNTERS.values()):
            return now
        if time.monotonic() > deadline:
            return now
        last = now
        time.sleep(0.05)

