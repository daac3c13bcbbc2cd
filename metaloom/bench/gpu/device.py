"""The machine `metaloom bench gpu` runs on: the device and tokenizer it uses (`setup`), the
versions a report names (`versions`), and the device's copy bandwidth, the limit a decode step's
weight reads are set against (`copy_bandwidth`). torch is imported only when called."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

from metaloom.bench import gpu_worker as gw
from metaloom.errors import InvalidParameter


def setup(args: argparse.Namespace) -> tuple[str, str, int]:
    """(device, tokenizer folder, vocabulary size)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from metaloom.models.engine.tokenizer import HFTokenizer
    from metaloom.models.find import resolve
    from metaloom.models.load import pick_device

    device = pick_device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InvalidParameter("device", args.device, "cpu here: CUDA is not available")
    folder = os.path.abspath(args.tokenizer) if args.tokenizer else resolve("default")[1]
    vocab = HFTokenizer(folder).vocab_size
    return str(device), folder, vocab


def versions(device: str, copy_gbs: float | None) -> dict[str, Any]:
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
