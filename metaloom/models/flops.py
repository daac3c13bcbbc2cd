"""FLOPs of a transformer forward, counted the way the scaling literature does (Kaplan et al.
2020, Appendix; Hoffmann et al. 2022): 2 FLOPs (multiply + add) per weight per token for every
matmul, plus the attention score and mix terms.

    flops = 2 * N_layer * T                      # q, k, v, o and MLP weights of all layers
          + 2 * V * d_model * R                   # the LM head, only for R rows of logits
          + 4 * L * n_heads * d_head * A          # QK^T and softmax(.)V

T: new tokens; A: key positions attended, summed over the new tokens (a token at position p
attends p + 1 keys); R: positions whose logits are computed (1 per row in prefill). Embedding
lookups, norms, RoPE and softmax are ignored, as usual (< 1% here).
"""

from __future__ import annotations


def forward_flops(*, layers: int, hidden: int, heads: int, kv_heads: int, head_dim: int,
                  intermediate: int, vocab: int, new_tokens: int, attended: int, logit_rows: int) -> float:
    per_layer_weights = (
        hidden * heads * head_dim  # q
        + 2 * hidden * kv_heads * head_dim  # k, v
        + heads * head_dim * hidden  # o
        + 3 * hidden * intermediate  # gate, up, down
    )
    return float(
        2 * layers * per_layer_weights * new_tokens
        + 2 * vocab * hidden * logit_rows
        + 4 * layers * heads * head_dim * attended
    )


def attended_keys(start_lengths: list[int], new_counts: list[int]) -> int:
    """Sum over rows and new tokens of the keys each new token attends (causal, no window)."""
    total = 0
    for start, count in zip(start_lengths, new_counts, strict=True):
        # tokens at positions start .. start+count-1 attend start+1 .. start+count keys
        total += count * start + count * (count + 1) // 2
    return total
