"""Constrained decoding: per-row cursors over a real grammar engine (llguidance).

A request names what its output must match with a `ConstraintSpec` (JSON Schema, regular
expression, Lark grammar, or a list of choices). The spec is compiled **once** against a
`Vocabulary` (one tokenizer + the model's vocabulary size) and every output row gets its own
cursor. Invalid or unsatisfiable specs raise `metaloom.errors.InvalidGrammar` at compile
time, before any model call.

The cursor API (`Constraint`), used by greedy, sampling and beam search alike::

    vocab = Vocabulary(tokenizer, model.vocab_size)         # once per tokenizer (~1 s)
    compiled = compile_constraint(spec, vocab)              # once per grammar
    cursor = compiled.cursor()                              # once per row
    allowed = cursor.mask()        # [V] bool: allowed next tokens; an end-of-sequence id is
                                   # allowed exactly when the text so far is a complete match
    cursor.advance(token)          # consume a token the mask allowed (else InvalidParameter)
    cursor.rollback(n)             # undo the last n advances (speculative decoding, backtracking)
    child = cursor.fork()          # independent copy: a beam that branches, a sample that forks
    cursor.done()                  # only an end token may follow: the row can finish now

For a batch, `batch_mask(cursors, V)` returns the [B, V] mask (rows whose cursor is None or
`unconstrained` allow everything) or None when no row is constrained; feed it to
`Sampler.process(..., mask=)` (pipeline step 3). Beam search: keep one cursor per live beam;
when beams are re-selected, give each new beam ``parent.fork()`` of the cursor it extends
(forking is a copy of the engine state, cheap next to a forward), then ``advance`` its token;
mask the candidate scores with `batch_mask` before the top-k so no beam leaves the grammar.

In the decode loop (`metaloom.decode.loop.decode`) a row finishes with ``"stop"`` as soon as
its cursor is `done` (no end token is spent) or when it draws an end token (allowed only once
the grammar accepts); a row that reaches ``max_tokens`` first ends with ``"length"`` and an
incomplete match, as with any other decoding. Regular expressions use llguidance's (Rust
`regex`) syntax: no look-around or back-references.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from metaloom.constrain.spec import ConstraintSpec

if TYPE_CHECKING:
    from metaloom.constrain.cursor import Constraint, batch_mask
    from metaloom.constrain.grammar import CompiledGrammar, GrammarCursor, compile_constraint
    from metaloom.constrain.vocab import Vocabulary

# the grammar engine, numpy and torch load on first use: a `ConstraintSpec` is plain data
_LAZY = {"Constraint": "metaloom.constrain.cursor", "batch_mask": "metaloom.constrain.cursor",
         "CompiledGrammar": "metaloom.constrain.grammar", "GrammarCursor": "metaloom.constrain.grammar",
         "compile_constraint": "metaloom.constrain.grammar", "Vocabulary": "metaloom.constrain.vocab"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["CompiledGrammar", "Constraint", "ConstraintSpec", "GrammarCursor", "Vocabulary", "batch_mask",
           "compile_constraint"]
