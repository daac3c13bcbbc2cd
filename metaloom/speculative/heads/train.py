"""Training speculator heads in the two phases described in the lecture "Decoding Strategies:
Current Research in Decoding" (IBM's MLP speculator, Wertheimer et al. 2024).

"They use a two phase approach to training a speculator":

- **Phase 1**: "train on small batches with long sequences with standard causal LM approach":
  a few whole sequences a step (human-written text and whole prompt + answer sequences), and
  every stage learns the text's own next tokens (stage i at position t: token t+i+1).
- **Phase 2**: "use large batches with short sequence lengths generated from the base model;
  tune the heads to match the output of the base model": many short windows a step, taken
  from the target's own greedy answers, so the labels are exactly the tokens the target emits
  (what greedy verification accepts).

Both phases are teacher-forced, as the hierarchy is used: stage i reads the true token t+i (a
wrong guess of the stage before ends the accepted draft anyway, so only the stage's behaviour
after a right guess matters). The loss is the sum of the stages' cross-entropies over the
draft vocabulary (labels outside it are skipped). Matmuls run under bfloat16 autocast (on a CPU
with AMX about 13x faster than float32; the master weights stay float32). The target's
embedding and LM head are frozen: only the stages' weights train.

`evaluate` drafts as decoding does (each stage fed the previous stage's own guess) over held-out
answers and reports each stage's accuracy and the mean number of leading correct guesses,
the expected accepted tokens per verification step of greedy speculative decoding.
"""

from __future__ import annotations

import dataclasses
import math
import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from metaloom.errors import InvalidParameter
from metaloom.speculative.heads.data import Example
from metaloom.speculative.heads.model import HeadsConfig, SpeculatorHeads

IGNORE = -100
PHASE2_LOSSES = ("soft", "argmax")


@dataclass(frozen=True)
class TrainConfig:
    stages: int = 4
    inner_size: int = 384
    draft_vocab: int = 8192
    phase1_steps: int = 150
    phase2_steps: int = 250
    phase1_batch: int = 4  # whole sequences a step
    phase2_batch: int = 64  # short windows a step
    window: int = 16
    lr1: float = 2e-3
    lr2: float = 1e-3
    weight_decay: float = 0.01
    warmup: int = 20
    seed: int = 0
    autocast: bool = True  # bfloat16 matmuls on CPU
    dropout: float = 0.0  # on the target's hidden state while training (against memorising positions)
    phase2_loss: str = "soft"  # "soft": the target's distribution; "argmax": its argmax token
    feature_weight: float = 0.0  # EAGLE-style regression of stage outputs onto the target's hidden states

    def __post_init__(self) -> None:
        for name in ("stages", "inner_size", "draft_vocab", "phase1_batch", "phase2_batch", "window"):
            if getattr(self, name) < 1:
                raise InvalidParameter(name, getattr(self, name), "an integer >= 1")
        if self.phase2_loss not in PHASE2_LOSSES:
            raise InvalidParameter("phase2_loss", self.phase2_loss, f"one of {list(PHASE2_LOSSES)}")
        for name in ("phase1_steps", "phase2_steps"):
            if getattr(self, name) < 0:
                raise InvalidParameter(name, getattr(self, name), "an integer >= 0")


@dataclass
class TrainReport:
    """Loss curves (summed over stages, per step), per-stage final losses, seconds per phase."""

    phase1_loss: list[float] = field(default_factory=list)
    phase2_loss: list[float] = field(default_factory=list)
    stage_loss: list[float] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)


def draft_vocabulary(examples: Sequence[Example], size: int, always: Sequence[int] = ()) -> torch.Tensor:
    """The ``size`` most frequent label tokens of ``examples`` (their tokens and the target's
    argmax; and ``always``, e.g. end-of-sequence ids), most frequent first: [V_d] long."""
    counts: Counter[int] = Counter()
    for e in examples:
        counts.update(e.tokens[e.start + 1:].tolist())
        if e.greedy is not None:
            counts.update(e.greedy[e.start:].tolist())
    ids = list(dict.fromkeys([*always, *(t for t, _ in counts.most_common(size))]))[:size]
    return torch.tensor(ids, dtype=torch.long)


@dataclass(frozen=True)
class Batch:
    """Training positions t: ``z`` [N, d] the target's hidden state at t; ``inputs`` [N, S] the
    stages' input tokens t+1 .. t+S (0 past the end); ``labels`` [N, S] draft-vocabulary index of
    each stage's label (IGNORE past the end or outside the draft vocabulary); ``teacher`` [N, S, d]
    the target's hidden state at each input token (its output there is what stage i must match)
    and ``valid`` [N, S] where that exists."""

    z: torch.Tensor
    inputs: torch.Tensor
    labels: torch.Tensor
    teacher: torch.Tensor
    valid: torch.Tensor


def batch(examples: Sequence[tuple[Example, torch.Tensor]], stages: int, label_index: torch.Tensor,
          target_labels: bool = False) -> Batch:
    """Labels: the text's tokens t+2 .. t+S+1 (causal LM), or with ``target_labels`` the target's
    own argmax after each input token (``Example.greedy``; on its greedy answers the two agree)."""
    zs, inputs, labels, teacher, valid = [], [], [], [], []
    steps = torch.arange(1, stages + 1)
    for e, t in examples:
        n = e.tokens.shape[0]
        idx = t[:, None] + steps[None, :]  # [P, S]: positions of the stages' input tokens
        inside = idx < n
        at = idx.clamp(max=n - 1)
        zs.append(e.hidden[t].float())
        inputs.append(torch.where(inside, e.tokens[at], 0))
        teacher.append(e.hidden[at])
        valid.append(inside)
        if target_labels:
            if e.greedy is None:
                raise InvalidParameter("target_labels", True, "examples with the target's argmax (Example.greedy)")
            lab, ok = e.greedy[at], inside
        else:
            lab, ok = e.tokens[(idx + 1).clamp(max=n - 1)], idx + 1 < n
        labels.append(torch.where(ok, label_index[lab], IGNORE))
    return Batch(torch.cat(zs), torch.cat(inputs), torch.cat(labels), torch.cat(teacher), torch.cat(valid))


def losses(heads: SpeculatorHeads, b: Batch, embed: torch.Tensor, head: torch.Tensor, autocast: bool, *,
           soft: bool = False, feature_weight: float = 0.0) -> list[torch.Tensor]:
    """Per-stage loss: cross-entropy with the labels, or with ``soft`` with the target's own
    distribution at the input token (softmax of its LM head over the draft vocabulary: "match the
    output of the base model"), plus ``feature_weight`` x smooth-L1 between the stage's output and
    the target's hidden state there (EAGLE's feature regression, Li et al. 2024)."""
    kind = b.z.device.type
    fast = autocast and kind in ("cpu", "cuda")
    with torch.autocast(kind, dtype=torch.bfloat16, enabled=fast):
        outputs = heads(b.z, b.inputs, embed)
        logits = [o @ head.T for o in outputs]
    out = []
    for i, (o, lg) in enumerate(zip(outputs, logits, strict=True)):
        ok = b.valid[:, i] if soft else b.labels[:, i] != IGNORE
        if not bool(ok.any()):
            out.append(lg.sum() * 0.0)
            continue
        if soft:
            with torch.no_grad(), torch.autocast(kind, dtype=torch.bfloat16, enabled=fast):
                target = torch.softmax((b.teacher[ok, i].to(head.dtype) @ head.T).float(), dim=-1)
            loss = -(target * torch.log_softmax(lg[ok].float(), dim=-1)).sum(-1).mean()
        else:
            loss = F.cross_entropy(lg.float(), b.labels[:, i], ignore_index=IGNORE)
        if feature_weight:
            loss = loss + feature_weight * F.smooth_l1_loss(o[ok].float(), b.teacher[ok, i].float())
        out.append(loss)
    return out


def _schedule(step: int, total: int, warmup: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def _positions(e: Example, first: int, count: int | None, rng: random.Random) -> torch.Tensor:
    """Positions t >= max(first, e.start) with at least one label (t+2 < T): all, or a random
    window of ``count`` consecutive ones."""
    lo, hi = max(first, e.start), e.tokens.shape[0] - 2
    if hi <= lo:
        return torch.empty(0, dtype=torch.long)
    if count is None or hi - lo <= count:
        return torch.arange(lo, hi)
    s = rng.randrange(lo, hi - count + 1)
    return torch.arange(s, s + count)


def train(phase1: Sequence[Example], phase2: Sequence[Example], embed: torch.Tensor, lm_head: torch.Tensor,
          config: TrainConfig, heads_config: HeadsConfig | None = None, *, always: Sequence[int] = (),
          device: torch.device | str = "cpu",
          log: Callable[[str], None] = lambda _: None) -> tuple[SpeculatorHeads, TrainReport]:
    """Train heads for the target whose frozen ``embed`` [V, d] and ``lm_head`` [V, d] are given.
    ``heads_config`` carries the target's identity (name, signature, probe); its sizes are set
    from ``config``. Batches are cut on the CPU and trained on ``device``; the heads come back
    on the CPU."""
    torch.manual_seed(config.seed)
    rng = random.Random(config.seed)
    vocab_ids = draft_vocabulary([*phase1, *phase2], config.draft_vocab, always)
    base = heads_config or HeadsConfig(stages=0, hidden_size=0, inner_size=0, vocab_size=0, draft_vocab=0)
    hc = HeadsConfig(stages=config.stages, hidden_size=embed.shape[1], inner_size=config.inner_size,
                     vocab_size=embed.shape[0], draft_vocab=len(vocab_ids), model_name=base.model_name,
                     signature=base.signature, probe=base.probe)
    heads = SpeculatorHeads(hc, vocab_ids).to(device)
    embed = embed.detach().float().to(device)
    head = lm_head.detach()[vocab_ids.to(lm_head.device)].float().to(device)
    label_index = torch.full((embed.shape[0],), IGNORE, dtype=torch.long)
    label_index[vocab_ids] = torch.arange(len(vocab_ids))
    report = TrainReport()
    # phase 2 labels: the target's own argmax when the examples carry it (else their tokens)
    has_greedy = all(e.greedy is not None for e in phase2)
    phases = ((1, phase1, config.phase1_steps, config.lr1, config.phase1_batch, None),
              (2, phase2, config.phase2_steps, config.lr2, config.phase2_batch, config.window))
    for number, examples, steps, lr, size, window in phases:
        pool = [e for e in examples if e.tokens.shape[0] - 2 > e.start]
        if not steps or not pool:
            continue
        opt = torch.optim.AdamW(heads.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=config.weight_decay)
        curve = report.phase1_loss if number == 1 else report.phase2_loss
        start = time.perf_counter()
        heads.train()
        for step in range(steps):
            for g in opt.param_groups:
                g["lr"] = lr * _schedule(step, steps, config.warmup)
            chosen = [(e, _positions(e, 0, window, rng)) for e in rng.choices(pool, k=size)]
            b = batch(chosen, config.stages, label_index, target_labels=number == 2 and has_greedy)
            b = Batch(*(getattr(b, f.name).to(device) for f in dataclasses.fields(b)))
            if config.dropout:
                b = dataclasses.replace(b, z=F.dropout(b.z, config.dropout))
            per_stage = losses(heads, b, embed, head, config.autocast, soft=number == 2 and config.phase2_loss == "soft",
                               feature_weight=config.feature_weight)
            loss = torch.stack(per_stage).sum()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(heads.parameters(), 1.0)
            opt.step()
            curve.append(float(loss.detach()))
            report.stage_loss = [float(x.detach()) for x in per_stage]
            if step % 25 == 0 or step == steps - 1:
                log(f"phase {number} step {step + 1}/{steps} loss {curve[-1]:.3f} "
                    f"(stages {' '.join(f'{x:.2f}' for x in report.stage_loss)}) {time.perf_counter() - start:.0f}s")
        report.seconds[f"phase{number}"] = time.perf_counter() - start
    return heads.cpu().eval(), report


@torch.no_grad()
def evaluate(heads: SpeculatorHeads, examples: Sequence[Example], embed: torch.Tensor,
             lm_head: torch.Tensor) -> dict[str, object]:
    """Draft as decoding does at every answer position of ``examples`` (stage 1 reads the target's
    token t+1, later stages the previous guess): per-stage accuracy given all earlier guesses
    right, and ``mean_accepted``, the mean number of leading right guesses (the expected accepted
    tokens per step of greedy speculative decoding on this text)."""
    k = heads.config.stages
    head = lm_head[heads.vocab_ids].float()
    emb = embed.float()
    correct_prefix = torch.zeros(k + 1)
    total = 0
    for e in examples:
        n = e.tokens.shape[0]
        t = torch.arange(e.start, n - 2)
        if not t.numel():
            continue
        drafted = heads.draft(e.hidden[t].float(), e.tokens[t + 1], k, emb, head)  # [P, k]
        truth_idx = (t[:, None] + torch.arange(2, k + 2)[None, :])
        inside = truth_idx < n
        truth = e.tokens[truth_idx.clamp(max=n - 1)]
        ok = (drafted == truth) & inside
        run = ok.long().cumprod(dim=1).sum(dim=1)  # leading right guesses
        for j in range(k + 1):
            correct_prefix[j] += float((run >= j).sum())
        total += t.numel()
    if not total:
        return {"positions": 0, "mean_accepted": 0.0, "stage_accuracy": [0.0] * k}
    stage_acc = [float(correct_prefix[j + 1] / correct_prefix[j]) if correct_prefix[j] else 0.0 for j in range(k)]
    return {"positions": total, "mean_accepted": float(correct_prefix[1:].sum() / total), "stage_accuracy": stage_acc}
