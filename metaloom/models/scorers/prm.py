"""A process reward model (PRM) from a local folder: the model behind `metaloom.score.prm`.
Scorers see only `StepRewardModel.step_rewards`: a question and partial solutions (lists of
step texts) in, one probability per step out; the tensors and the PRM's tokenizer stay here.

Two public conventions, picked from the folder's ``config.json`` (``convention="auto"``):

- ``"classification"``: a token-classification head read at step-separator tokens
  (Qwen2.5-Math-PRM: architecture ``Qwen2ForProcessRewardModel``, its own modeling code loaded
  with ``trust_remote_code``; also transformers' ``*ForTokenClassification`` models). The
  conversation is system / user = the question / assistant = the steps, each followed by the
  separator (default ``<extra_0>``), through the tokenizer's chat template; a step's reward is
  softmax(logits)[1] at its separator (sigmoid of the logit for a one-label head).
- ``"tag"``: a causal LM that predicts a "good"/"bad" token at a step tag after each step
  (Math-Shepherd: ``question + " " + steps``, each step followed by ``" ки"``, joined by
  newlines); a step's reward is softmax over the [good, bad] logits at its tag, of good.

Steps arrive with their delimiter (e.g. a trailing "\\n\\n"); trailing whitespace of each step
is stripped before the separator / tag is appended, as both models were trained. A step that
already ends with the tag (a Math-Shepherd-style policy writes it) is not tagged twice.

Every step gets a score or the call fails: an input longer than ``max_length`` raises
`ContextWindowExceeded` (nothing is truncated), and a separator or tag inside the texts
(which would shift which position belongs to which step) raises `InvalidParameter`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import torch

from metaloom.errors import ContextWindowExceeded, InvalidParameter, ModelNotFound, NotAModel, UnsupportedModel

CONVENTIONS = ("auto", "classification", "tag")
QWEN_PRM_SYSTEM = "Please reason step by step, and put your final answer within \\boxed{}."
DEFAULT_SEPARATOR = "<extra_0>"
ACCEPTED = ("classification: architectures '*ProcessRewardModel' (Qwen2.5-Math-PRM) or '*ForTokenClassification' "
            "with 1 or 2 labels; tag: architectures '*ForCausalLM' (Math-Shepherd)")
DTYPES = ("auto", "float32", "bfloat16", "float16")


def _architectures(path: str) -> list[str]:
    """The ``architectures`` of the folder's config.json (typed errors for a missing or
    unreadable one)."""
    if not os.path.isdir(path):
        raise ModelNotFound(f"process reward model folder not found: {path}")
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise NotAModel(f"{path} has no config.json: not a transformers model folder (a process reward model needs one; "
                        f"accepted: {ACCEPTED})")
    try:
        with open(config_file, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise NotAModel(f"{config_file} is not readable JSON: {exc}") from exc
    found = config.get("architectures") if isinstance(config, dict) else None
    if not isinstance(found, list) or not all(isinstance(a, str) for a in found):
        raise UnsupportedModel(f"{config_file} names no architectures (found {found!r}): cannot tell a process reward "
                               f"model's convention; accepted: {ACCEPTED}")
    return found


def _family(architectures: Sequence[str]) -> str | None:
    """'remote', 'token' or 'causal' for the first architecture of a known kind, else None."""
    for arch in architectures:
        if "ProcessRewardModel" in arch:
            return "remote"
        if arch.endswith("ForTokenClassification"):
            return "token"
        if arch.endswith("ForCausalLM"):
            return "causal"
    return None


def _single_token(tokenizer: Any, text: str) -> int | None:
    """The id of ``text`` when the tokenizer encodes it as exactly one token, else None."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) != 1 or (ids[0] == tokenizer.unk_token_id and text != tokenizer.unk_token):
        return None
    return int(ids[0])


class StepRewardModel:
    """A loaded PRM and its tokenizer (build one with `load`)."""

    def __init__(self, model: Any, tokenizer: Any, *, convention: str, marker_id: int, marker: str,
                 label_ids: tuple[int, int] | None = None, system: str = QWEN_PRM_SYSTEM, batch_size: int = 8,
                 max_length: int = 4096, remote_code: bool = False) -> None:
        if convention not in ("classification", "tag"):
            raise InvalidParameter("convention", convention, "'classification' or 'tag'")
        if convention == "tag" and label_ids is None:
            raise InvalidParameter("label_ids", label_ids, "the (good, bad) token ids of a tag-convention PRM")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise InvalidParameter("batch_size", batch_size, "an integer >= 1")
        if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
            raise InvalidParameter("max_length", max_length, "an integer >= 1")
        self.model = model
        self.tokenizer = tokenizer
        self.convention = convention
        self.marker_id = marker_id  # the separator (classification) or step tag (tag) token id
        self.marker = marker
        self.label_ids = label_ids
        self.system = system
        self.batch_size = batch_size
        self.max_length = max_length
        self.remote_code = remote_code

    @classmethod
    def load(cls, path: str, *, convention: str = "auto", device: str = "cpu", dtype: str = "auto",
             step_separator: str | None = None, good_token: str = "+", bad_token: str = "-", step_tag: str = "ки",
             system: str = QWEN_PRM_SYSTEM, batch_size: int = 8, max_length: int = 4096,
             trust_remote_code: bool = True) -> StepRewardModel:
        """A PRM from a local folder. ``convention``: "auto" (from config.json's
        architectures), "classification" or "tag" (checked against them). ``step_separator``:
        the classification convention's separator (None: "<extra_0>", which must then be one
        token); ``good_token`` / ``bad_token`` / ``step_tag``: the tag convention's tokens;
        ``system``: the classification convention's system message ("" for none)."""
        if convention not in CONVENTIONS:
            raise InvalidParameter("convention", convention, f"one of {list(CONVENTIONS)}")
        if dtype not in DTYPES:
            raise InvalidParameter("dtype", dtype, f"one of {list(DTYPES)}")
        architectures = _architectures(path)
        family = _family(architectures)
        wanted = {"classification": ("remote", "token"), "tag": ("causal",)}
        if family is None or (convention != "auto" and family not in wanted[convention]):
            asked = "" if convention == "auto" else f" for convention {convention!r}"
            raise UnsupportedModel(f"{path} is not a process reward model{asked}: its config.json names architectures "
                                   f"{architectures}; accepted: {ACCEPTED}")
        chosen = "tag" if family == "causal" else "classification"

        import transformers

        try:
            tokenizer: Any = transformers.AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError, TypeError) as exc:
            raise NotAModel(f"{path}: no usable tokenizer ({type(exc).__name__}: {exc})") from exc

        label_ids: tuple[int, int] | None = None
        if chosen == "classification":
            marker = DEFAULT_SEPARATOR if step_separator is None else step_separator
            found = _single_token(tokenizer, marker) if marker else None
            if found is None:
                why = "a separator this tokenizer encodes as exactly one token" + (
                    f" (the default {DEFAULT_SEPARATOR!r} is not one here: name the model's own)"
                    if step_separator is None else "")
                raise InvalidParameter("step_separator", marker, why)
            marker_id = found
        else:
            good, bad = _single_token(tokenizer, good_token), _single_token(tokenizer, bad_token)
            # Math-Shepherd's README: candidate_tokens = encode(f"{good} {bad}")[1:] (without BOS)
            pair = tokenizer.encode(f"{good_token} {bad_token}", add_special_tokens=False)
            if len(pair) != 2 or good is None or bad is None or pair[0] == pair[1]:
                missing = [name for name, tok in (("good_token", good), ("bad_token", bad)) if tok is None]
                raise InvalidParameter("/".join(missing) or "good_token/bad_token", (good_token, bad_token),
                                       "two distinct texts that each exist as a single token of this tokenizer" +
                                       (f" ({' and '.join(missing)} is not one)" if missing else
                                        f" ('{good_token} {bad_token}' encodes as {len(pair)} tokens)"))
            label_ids = (int(pair[0]), int(pair[1]))
            # the tag as it stands in the text, after a step and a space (Math-Shepherd's README takes
            # encode(step_tag)[-1]: the same token for its sentencepiece tokenizer, which prefixes a space)
            tag_ids = tokenizer.encode(f"x {step_tag}", add_special_tokens=False) if step_tag.strip() else []
            if not tag_ids or tokenizer.decode([tag_ids[-1]]).strip() != step_tag.strip():
                raise InvalidParameter("step_tag", step_tag, "a tag this tokenizer encodes as one token after a space")
            marker, marker_id = step_tag, int(tag_ids[-1])

        kwargs: dict[str, Any] = {"dtype": dtype if dtype == "auto" else getattr(torch, dtype)}
        remote = family == "remote"
        if remote and not trust_remote_code:
            raise UnsupportedModel(f"{path} ({architectures[0]}) runs its own modeling code: load it with "
                                   f"trust_remote_code=True")
        try:
            if remote:
                model = transformers.AutoModel.from_pretrained(path, trust_remote_code=True, **kwargs)
            elif family == "token":
                model = transformers.AutoModelForTokenClassification.from_pretrained(path, **kwargs)
            else:
                model = transformers.AutoModelForCausalLM.from_pretrained(path, **kwargs)
        except OSError as exc:
            raise NotAModel(f"{path}: cannot load its weights ({exc})") from exc
        except (ValueError, KeyError, ImportError, AttributeError, TypeError) as exc:
            raise UnsupportedModel(f"{path} ({architectures[0]}): transformers {transformers.__version__} cannot load it "
                                   f"({type(exc).__name__}: {exc})") from exc
        model = model.to(device).eval()
        if family == "token" and int(model.config.num_labels) not in (1, 2):
            raise UnsupportedModel(f"{path} is a token classifier with {model.config.num_labels} labels; a process reward "
                                   f"model reads 1 (sigmoid) or 2 (softmax, label 1 = good) at each step")
        return cls(model, tokenizer, convention=chosen, marker_id=marker_id, marker=marker, label_ids=label_ids,
                   system=system, batch_size=batch_size, max_length=max_length, remote_code=remote)

    # ------------------------------------------------------------------------------------------------

    def render(self, question: str, steps: Sequence[str]) -> list[int]:
        """The token ids of one partial solution, in the model's convention."""
        for i, step in enumerate(steps):
            if not isinstance(step, str):
                raise InvalidParameter(f"steps[{i}]", step, "a string")
        bare = [s.rstrip() for s in steps]
        if self.convention == "tag":
            # Math-Shepherd: f"{question} {output}", each step of the output ending " ки", one per
            # line. A step already ending with the tag is not tagged twice; a tag elsewhere (the
            # tag text inside a word is harmless) is caught by the count of tags in `step_rewards`.
            bare = [s[:-len(self.marker)].rstrip() if s.endswith(self.marker) else s for s in bare]
            text = question + " " + "\n".join(f"{s} {self.marker}" for s in bare)
            return list(self.tokenizer.encode(text))
        # the separator is (usually) an added token: one token wherever its text appears
        if self.marker in question:
            raise InvalidParameter("question", question, f"a text without the PRM's step separator {self.marker!r}")
        for i, step in enumerate(bare):
            if self.marker in step:
                raise InvalidParameter(f"steps[{i}]", steps[i], f"a step without the PRM's step separator "
                                                                f"{self.marker!r} inside it (each step gets one score)")
        answer = "".join(s + self.marker for s in bare)
        if getattr(self.tokenizer, "chat_template", None):
            messages = ([{"role": "system", "content": self.system}] if self.system else []) + [
                {"role": "user", "content": question}, {"role": "assistant", "content": answer}]
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
            return list(self.tokenizer.encode(text, add_special_tokens=False))
        # no chat template (a plain token classifier): the question, a blank line, the steps
        return list(self.tokenizer.encode(question + "\n\n" + answer))

    def _probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        """[B, T, ...] logits -> [B, T] probability that a step ending there is good."""
        logits = logits.float()
        if self.convention == "tag":
            assert self.label_ids is not None
            return torch.softmax(logits[..., list(self.label_ids)], dim=-1)[..., 0]
        if logits.shape[-1] == 2:
            return torch.softmax(logits, dim=-1)[..., 1]
        if logits.shape[-1] == 1:
            return torch.sigmoid(logits[..., 0])
        raise UnsupportedModel(f"the process reward model gives {logits.shape[-1]} logits per token; the classification "
                               f"convention reads 2 (softmax, label 1 = good) or 1 (sigmoid)")

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            try:
                out = self.model(input_ids=ids, attention_mask=mask)
            except (AttributeError, TypeError, ImportError, NotImplementedError) as exc:
                if not self.remote_code:
                    raise
                import transformers

                raise UnsupportedModel(f"the model's own modeling code (trust_remote_code) fails under transformers "
                                       f"{transformers.__version__}: {type(exc).__name__}: {exc}") from exc
        logits = out.logits if hasattr(out, "logits") else out[0]
        if logits.dim() != 3 or logits.shape[:2] != ids.shape:
            raise UnsupportedModel(f"the process reward model returned logits of shape {tuple(logits.shape)}; expected "
                                   f"one row per token, [batch, tokens, labels] = [{ids.shape[0]}, {ids.shape[1]}, ...]")
        return self._probabilities(logits)

    def step_rewards(self, question: str, partials: Sequence[Sequence[str]]) -> list[list[float]]:
        """For each partial solution, the probability that each of its steps is good, in [0, 1]
        (one per step; [] for a partial with no steps). Batches of ``batch_size``, right-padded."""
        encoded: list[list[int]] = []
        todo: list[int] = []
        for i, steps in enumerate(partials):
            if isinstance(steps, str):
                raise InvalidParameter(f"partials[{i}]", steps, "a list of step texts, not one string")
            ids = self.render(question, steps) if steps else []
            if len(ids) > self.max_length:
                raise ContextWindowExceeded(len(ids), self.max_length, f"process reward model input {i} (the question and "
                                                                       f"{len(steps)} steps; max_length={self.max_length})")
            encoded.append(ids)
            if steps:
                todo.append(i)
        out: list[list[float]] = [[] for _ in partials]
        device = next(self.model.parameters()).device
        for lo in range(0, len(todo), self.batch_size):
            rows = todo[lo:lo + self.batch_size]
            width = max(len(encoded[i]) for i in rows)
            batch = torch.zeros((len(rows), width), dtype=torch.long)  # padding: masked out, any valid id will do
            mask = torch.zeros((len(rows), width), dtype=torch.long)
            for r, i in enumerate(rows):
                batch[r, :len(encoded[i])] = torch.tensor(encoded[i], dtype=torch.long)
                mask[r, :len(encoded[i])] = 1
            probs = self._forward(batch.to(device), mask.to(device)).cpu()
            for r, i in enumerate(rows):
                at = ((batch[r] == self.marker_id) & (mask[r] == 1)).nonzero().flatten()
                if len(at) != len(partials[i]):
                    raise InvalidParameter(f"partials[{i}]", list(partials[i]),
                                           f"steps whose rendering has one {self.marker!r} token per step (found {len(at)} "
                                           f"for {len(partials[i])} steps: a text holds the marker, or the tokenizer merged "
                                           f"it with its neighbours)")
                out[i] = probs[r, at].tolist()
        return out
