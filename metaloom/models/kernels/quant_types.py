"""The ggml tensor types the quantised matmul reads (`metaloom.models.kernels.quant`): each type's
block size and bytes, as GGUF stores them, and the kernels' input multiple."""

from __future__ import annotations

from dataclasses import dataclass

from metaloom.errors import UnsupportedModel


@dataclass(frozen=True)
class QType:
    """A ggml tensor type: ``block`` elements stored in ``bytes`` bytes (GGUF's sizes);
    ``kernel_block``: what the input dimension must be a multiple of for the C kernels (raw
    F16/BF16 values are walked 32 at a time)."""

    name: str
    block: int
    bytes: int
    kernel_block: int

    def row_bytes(self, in_features: int) -> int:
        return in_features // self.block * self.bytes


QTYPES: dict[int, QType] = {
    1: QType("F16", 1, 2, 32),
    2: QType("Q4_0", 32, 18, 32),
    3: QType("Q4_1", 32, 20, 32),
    6: QType("Q5_0", 32, 22, 32),
    7: QType("Q5_1", 32, 24, 32),
    8: QType("Q8_0", 32, 34, 32),
    10: QType("Q2_K", 256, 84, 256),
    11: QType("Q3_K", 256, 110, 256),
    12: QType("Q4_K", 256, 144, 256),
    13: QType("Q5_K", 256, 176, 256),
    14: QType("Q6_K", 256, 210, 256),
    20: QType("IQ4_NL", 32, 18, 32),
    23: QType("IQ4_XS", 256, 136, 256),
    30: QType("BF16", 1, 2, 32),
}
BY_NAME: dict[str, int] = {q.name: k for k, q in QTYPES.items()}


def qtype_id(qtype: int | str) -> int:
    """A type id from an id or a name ("Q4_0"); an unknown one is an `UnsupportedModel`."""
    key = BY_NAME.get(qtype) if isinstance(qtype, str) else qtype
    if not isinstance(key, int) or key not in QTYPES:
        names = ", ".join(f"{q.name}={k}" for k, q in QTYPES.items())
        raise UnsupportedModel(f"GGML tensor type {qtype!r} is not one the quantised matmul reads ({names})")
    return key
