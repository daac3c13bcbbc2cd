"""What a speculator heads' draft costs on the default model, in isolation (warm caches): the
draft vocabulary's head rows as float32 (dequantised, as before 9ec4b8c) against the target's own
quantised rows (`metaloom.speculative.drafters.heads.draft_head`); one stage (a draft the heads
stop after, unsure) and three; and the head's product alone. Medians of 300 calls. Not a test.

    python scripts/heads_stage.py [ACTIVATIONS]     (q8, the default, or float)
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from metaloom.models import load
from metaloom.models.engine.weights import embed_tokens, linear, plain_weight
from metaloom.models.kernels.isa import cpu_name
from metaloom.speculative.drafters.heads import draft_head, heads_for

sys.path.insert(0, str(Path(__file__).parent))
from quant_kernel_speed import median_seconds


def main() -> None:
    activations = sys.argv[1] if len(sys.argv) > 1 else "q8"
    model = load("default", activations=activations).model
    heads = heads_for(model)
    rows = {"float32 rows": embed_tokens(plain_weight(model.lm_head), heads.vocab_ids, torch.float32).float(),
            "quantised rows": draft_head(model.lm_head, heads.vocab_ids)}
    z, first = torch.randn(1, model.config.hidden_size), torch.tensor([42])
    x = torch.randn(1, model.config.hidden_size)
    print(f"{cpu_name()}, {torch.get_num_threads()} threads, {activations} activations, "
          f"{heads.config.draft_vocab} draft rows")
    for name, head in rows.items():
        one = median_seconds(lambda h=head: heads.draft_confident(z, first, 3, model.embed, h, 0.99), 300) * 1e6
        three = median_seconds(lambda h=head: heads.draft_confident(z, first, 3, model.embed, h, 0.0), 300) * 1e6
        product = median_seconds(lambda h=head: linear(x, h), 300) * 1e6
        print(f"{name:15s} one stage {one:7.1f} us, three {three:7.1f} us, the head's product {product:6.1f} us")


if __name__ == "__main__":
    main()
