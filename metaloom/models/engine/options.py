"""How the native engine holds and reads its KV cache: the choices a user makes per load.

- ``kv_dtype``: the KV pool's element type. ``auto`` keeps the activations' dtype; ``int8``
  stores keys and values as int8 with a float32 scale per token and head (what the fused
  kernels read directly); ``float32`` / ``bfloat16`` name a float type.
- ``shared_prefix_attention``: Hydragen-style attention (Juravsky et al. 2024) over the keys
  that several rows of a decode step share in the pool (forks of one prompt, a subtree of a
  search): ``on`` always, ``off`` never, ``auto`` where the step has enough sharing to gain
  (`metaloom.models.engine.sharing`).
- ``kv_policy`` and ``kv_budget``: which positions a row keeps once it holds more than
  ``kv_budget`` tokens (`metaloom.models.engine.kv_policy`): ``full`` keeps every one (no
  budget); ``streaming`` (StreamingLLM), ``h2o`` (heavy hitters) and ``snapkv`` (the prompt
  compressed by its observation window) drop the rest.

A frozen value passed to `LlamaModel` (and kept by ``packed`` / ``with_fused``), set by
`metaloom.models.load.load` from the command line's ``--kv-dtype``,
``--shared-prefix-attention``, ``--kv-policy`` and ``--kv-budget``.
"""

from __future__ import annotations

from dataclasses import dataclass

from metaloom.errors import InvalidParameter
from metaloom.models.engine.kv_policy import check_policy

KV_DTYPES = ("auto", "float32", "bfloat16", "int8")
SHARED_PREFIX_MODES = ("auto", "on", "off")


@dataclass(frozen=True)
class EngineOptions:
    kv_dtype: str = "auto"
    shared_prefix_attention: str = "auto"
    kv_policy: str = "full"
    kv_budget: int | None = None

    def __post_init__(self) -> None:
        if self.kv_dtype not in KV_DTYPES:
            raise InvalidParameter("kv_dtype", self.kv_dtype, f"one of {list(KV_DTYPES)}")
        if self.shared_prefix_attention not in SHARED_PREFIX_MODES:
            raise InvalidParameter("shared_prefix_attention", self.shared_prefix_attention,
                                   f"one of {list(SHARED_PREFIX_MODES)}")
        check_policy(self.kv_policy, self.kv_budget)

    @property
    def drops(self) -> bool:
        """Whether rows may drop positions (a policy other than ``full``)."""
        return self.kv_policy != "full"
