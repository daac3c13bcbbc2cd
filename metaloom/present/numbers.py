"""Numbers as people read them: scores to 3 decimals, counts with thousands separators, FLOPs
in engineering units, memory in binary units, usage figures with "?" for what a run could not count and "~" for an
estimate. Shared by `metaloom tree` (`metaloom.present.tree`) and `metaloom report`
(`metaloom.eval.report.cells`, which shows a missing figure as "–")."""

from __future__ import annotations

import math
from typing import Any

from metaloom.present.text import clean

UNKNOWN = "?"  # a figure the run could not count (null in the JSON)
_PREFIXES = ("", "k", "M", "G", "T", "P", "E", "Z", "Y")


def is_int(v: Any) -> bool:
    """An integer, and not a bool."""
    return isinstance(v, int) and not isinstance(v, bool)


def finite(v: Any) -> bool:
    """A finite number (int or float), and not a bool."""
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def fmt_score(v: Any) -> str:
    """A score to 3 decimals; anything else as it is."""
    return f"{v:.3f}" if finite(v) else clean(v)


def fmt_compact(v: Any) -> str:
    """An integer as it is, a float to 3 significant figures."""
    if is_int(v):
        return str(v)
    return f"{v:.3g}" if finite(v) else clean(v)


def fmt_count(v: Any) -> str:
    return f"{v:,}" if is_int(v) else fmt_compact(v)


def fmt_flops(v: Any) -> str:
    """FLOPs in engineering units: 1.2e9 -> "1.2 GFLOP"."""
    if not finite(v):
        return clean(v)
    if v == 0:
        return "0 FLOP"
    exp = min(max(math.floor(math.log10(abs(v)) / 3), 0), len(_PREFIXES) - 1)
    mantissa = float(f"{v / 1000 ** exp:.3g}")
    if abs(mantissa) >= 1000 and exp < len(_PREFIXES) - 1:  # 999.7e9 rounds to 1e3 G: say 1 T
        exp += 1
        mantissa = float(f"{v / 1000 ** exp:.3g}")
    return f"{mantissa:g} {_PREFIXES[exp]}FLOP"


def fmt_seconds(v: Any) -> str:
    return f"{v:.2f}" if finite(v) else clean(v)


_BINARY = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def fmt_bytes(v: Any) -> str:
    """Bytes in binary units, as memory is sized: 5632 -> "5.5 KiB", 2**30 -> "1 GiB"."""
    if not finite(v):
        return clean(v)
    exp = min(max(math.floor(math.log2(abs(v)) / 10), 0), len(_BINARY) - 1) if v else 0
    if exp == 0:
        return f"{v:g} B"
    mantissa = float(f"{v / 1024 ** exp:.3g}")
    if abs(mantissa) >= 1024 and exp < len(_BINARY) - 1:  # 1023.9 KiB rounds to 1.02e3: say 1 MiB
        exp += 1
        mantissa = float(f"{v / 1024 ** exp:.3g}")
    return f"{mantissa:g} {_BINARY[exp]}"


_USAGE_FORMAT = {"flops": fmt_flops, "seconds": fmt_seconds, "kv_bytes_peak": fmt_bytes}


def fmt_usage(key: str, v: Any, estimated: bool = False) -> str:
    """One usage figure: "?" where it is unknown (null), "~" before an estimate."""
    if v is None:
        return UNKNOWN
    return ("~" if estimated else "") + _USAGE_FORMAT.get(key, fmt_count)(v)
