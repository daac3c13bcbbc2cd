"""Drafters: prompt lookup (`ngram`), a draft model (`draft_model`), quantised self-draft
(`quantized`), Jacobi iteration (`jacobi`). Each implements `metaloom.speculative.Drafter`."""
