"""Hierarchical speculator heads: Medusa's extra heads, each stage fed the previous stage's token.

Medusa (Cai et al. 2024, "Medusa: simple LLM inference acceleration framework with multiple
decoding heads") attaches heads to the target's last hidden state ``z_t`` that predict the
tokens at t+2, t+3, ... independently. The speculator described in the lecture "Decoding
Strategies: Current Research in Decoding" ("based on the Medusa paper ... make heads
hierarchical, where each head stage predicts a token and then feeds it into the next head
stage; Z is the hidden state from the base model and T1 .. T4 are the generated tokens"; IBM's
MLP speculator, Wertheimer et al. 2024, "Accelerating production LLMs with combined
token/embedding speculators") chains them instead. With ``s_0 = z_t`` and ``T_1`` the token
the target itself emitted after t, stage i (1 .. K) computes::

    s_i = GELU(LayerNorm_i(A_i s_{i-1} + B_i E[T_i]))       # state: r values
    logits_i = H · (O_i s_i)                                 # over the draft vocabulary
    T_{i+1} = argmax logits_i                                # the guess for token t+i+1

so a stage knows which token the stage before it guessed, and its state carries what the
earlier stages computed. ``E`` and ``H`` are the target's own (frozen) embedding and LM head,
so the heads hold only A_i, B_i, O_i and the norms: about 0.6M parameters a stage for the
default model. ``H`` is cut to a draft vocabulary of the most frequent tokens in the training
text (Zhao et al. 2025, "FR-Spec: frequency-ranked speculative sampling"): the output layer
then costs 8k instead of 49k rows a stage, in training and when drafting; a token outside it
is never drafted, which costs acceptance only, never exactness.

Heads are saved as safetensors with a JSON header (``metaloom-heads``): the target's name,
its architecture signature and a probe of its embedding (to match a loaded model to its
heads), stages and sizes.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from metaloom.errors import NotAModel
from metaloom.models.engine.llama import Embedding, embed_tokens
from metaloom.models.engine.weights import Weight, linear

FORMAT = "metaloom-heads"
FORMAT_VERSION = 1
SIGNATURE_FIELDS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "intermediate_size")
PROBE_ROWS = (1, 100, 1000, 10000)  # embedding rows (mod vocab) whose first 4 values fingerprint a model


@dataclass(frozen=True)
class HeadsConfig:
    """``hidden_size`` d of the target, ``inner_size`` r of the stages' state, ``draft_vocab`` rows
    of the LM head the heads predict over; ``model_name``/``signature``/``probe`` identify the target."""

    stages: int
    hidden_size: int
    inner_size: int
    vocab_size: int
    draft_vocab: int
    model_name: str = ""
    signature: dict[str, object] | None = None
    probe: tuple[float, ...] = ()

    def to_json(self) -> str:
        return json.dumps(asdict(self) | {"format": FORMAT, "version": FORMAT_VERSION})

    @classmethod
    def from_json(cls, text: str) -> HeadsConfig:
        raw = json.loads(text)
        if raw.pop("format", None) != FORMAT:
            raise NotAModel("not a speculator heads file (its header has no 'metaloom-heads' format)")
        raw.pop("version", None)
        raw["probe"] = tuple(raw.get("probe", ()))
        return cls(**raw)


def model_signature(model: object) -> dict[str, object]:
    """The architecture fields that must match between a target and its heads."""
    config = getattr(model, "config", None)
    return {f: getattr(config, f, None) for f in SIGNATURE_FIELDS}


def model_probe(model: object) -> tuple[float, ...]:
    """A few embedding values: a cheap fingerprint of the weights that survives a cast to bf16."""
    embed = model.embed  # type: ignore[attr-defined]  # a tensor, or quantised blocks (native weights)
    rows = torch.as_tensor([r % embed.shape[0] for r in PROBE_ROWS], device=model.device)  # type: ignore[attr-defined]
    return tuple(float(x) for x in embed_tokens(embed, rows, torch.float32)[:, :4].float().reshape(-1).tolist())


def matches(config: HeadsConfig, model: object) -> bool:
    """Whether heads trained for ``config`` fit ``model`` (same architecture, about the same weights)."""
    if config.signature is None or config.signature != model_signature(model):
        return False
    if not config.probe:
        return True
    ours = torch.tensor(model_probe(model))
    return bool(torch.allclose(ours, torch.tensor(config.probe), rtol=2e-2, atol=2e-3))


def _weight(layer: nn.Module) -> torch.Tensor:
    """An nn.Linear's weight [out, in] (typed: a ModuleList's entries are plain Modules)."""
    assert isinstance(layer, nn.Linear)
    return layer.weight


class SpeculatorHeads(nn.Module):
    """K hierarchical stages (see the module doc). ``vocab_ids`` [V_d]: target token id of each
    row of the draft vocabulary."""

    vocab_ids: torch.Tensor  # a registered buffer (moves with .to())

    def __init__(self, config: HeadsConfig, vocab_ids: torch.Tensor) -> None:
        super().__init__()
        d, r = config.hidden_size, config.inner_size
        self.config = config
        self.state_in = nn.ModuleList([nn.Linear(d if i == 0 else r, r, bias=False) for i in range(config.stages)])
        self.token_in = nn.ModuleList([nn.Linear(d, r, bias=False) for _ in range(config.stages)])
        self.norm = nn.ModuleList([nn.LayerNorm(r) for _ in range(config.stages)])
        self.out = nn.ModuleList([nn.Linear(r, d, bias=False) for _ in range(config.stages)])
        self.register_buffer("vocab_ids", vocab_ids.to(torch.long).clone())

    def stage(self, i: int, state: torch.Tensor, token_embedding: torch.Tensor) -> torch.Tensor:
        """s_i [N, r] from s_{i-1} [N, d or r] and E[T_i] [N, d]."""
        # `linear`: one row (drafting) as a matrix-vector product, several as nn.Linear's F.linear
        return F.gelu(self.norm[i](linear(state, _weight(self.state_in[i]))
                                   + linear(token_embedding, _weight(self.token_in[i]))))

    def forward(self, z: torch.Tensor, inputs: torch.Tensor, embed: torch.Tensor) -> list[torch.Tensor]:
        """Teacher-forced training pass. z [N, d]: the target's hidden state at t; inputs [N, S]:
        stage i reads token t+1+i (the true one, not the previous stage's guess); embed [V, d].
        Returns S outputs O_i s_i [N, d] (the LM head's input space; logits = output @ head.T)."""
        state, out = z, []
        for i in range(inputs.shape[1]):
            state = self.stage(i, state, F.embedding(inputs[:, i], embed))
            out.append(self.out[i](state))
        return out

    @torch.no_grad()
    def draft(self, z: torch.Tensor, first: torch.Tensor, k: int, embed: Embedding, head: Weight) -> torch.Tensor:
        """Hierarchical drafting: z [B, d] the target's hidden state at the last token it saw,
        first [B] the token it emitted after it; returns [B, k] target token ids (k <= stages)."""
        return self.draft_confident(z, first, k, embed, head)[0]

    @torch.no_grad()
    def draft_confident(self, z: torch.Tensor, first: torch.Tensor, k: int, embed: Embedding, head: Weight,
                        min_prob: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
        """`draft`, plus [B] the number of leading stages whose guess has probability >=
        ``min_prob`` under the stage's own softmax: a draft cut there spends no verify width on
        guesses the heads themselves doubt (EAGLE-2, Li et al. 2024, uses the draft's confidence
        the same way to size its tree). Stops early once no row is confident."""
        state, token = z, first
        b = z.shape[0]
        drafted = torch.zeros(b, k, dtype=torch.long, device=z.device)
        confident = torch.zeros(b, dtype=torch.long, device=z.device)
        alive = torch.ones(b, dtype=torch.bool, device=z.device)
        for i in range(k):
            state = self.stage(i, state, embed_tokens(embed, token, state.dtype).to(state.dtype))
            logits = linear(linear(state, _weight(self.out[i])), head)  # head: a tensor or quantised rows
            best, index = logits.max(dim=-1)
            token = self.vocab_ids[index]
            drafted[:, i] = token
            if min_prob > 0.0:
                # p(best) = 1 / sum(exp(logits - best))
                alive &= torch.exp(best - torch.logsumexp(logits.float(), dim=-1)) >= min_prob
                if not bool(alive.any()):
                    break
            confident += alive.long()
        return drafted, confident

    def flops_per_token(self) -> float:
        """FLOPs of drafting one token (one stage), LM head rows included."""
        c = self.config
        return 2.0 * (c.inner_size * (c.hidden_size + c.inner_size) + 2 * c.inner_size * c.hidden_size
                      + c.draft_vocab * c.hidden_size)


def save_heads(heads: SpeculatorHeads, path: str, dtype: torch.dtype = torch.bfloat16) -> None:
    """Weights in ``dtype`` (bf16 halves the file; drafting runs in float32), vocab ids in int32."""
    from safetensors.torch import save_file

    tensors = {name: t.detach().to(dtype).contiguous() for name, t in heads.state_dict().items() if name != "vocab_ids"}
    tensors["vocab_ids"] = heads.vocab_ids.to(torch.int32).contiguous()
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, path, metadata={"format": FORMAT, "config": heads.config.to_json()})


def read_config(path: str) -> HeadsConfig:
    """The header of a heads file, without reading its weights."""
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
    except Exception as exc:  # safetensors raises its own error types on corrupt files
        raise NotAModel(f"{path} is not a readable safetensors file: {exc}") from exc
    if meta.get("format") != FORMAT or "config" not in meta:
        raise NotAModel(f"{path} is not a speculator heads file (no '{FORMAT}' header)")
    return HeadsConfig.from_json(meta["config"])


def load_heads(path: str) -> SpeculatorHeads:
    """Heads in float32, in eval mode."""
    from safetensors.torch import load_file

    config = read_config(path)
    tensors = load_file(path)
    heads = SpeculatorHeads(config, tensors.pop("vocab_ids").to(torch.long))
    missing, unexpected = heads.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=False)
    if [m for m in missing if m != "vocab_ids"] or unexpected:
        raise NotAModel(f"{path}: heads weights do not match their header (missing {missing}, unexpected {unexpected})")
    return heads.eval()
