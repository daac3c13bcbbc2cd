"""The committed runs the docs cite: every `runs/...` path a page names exists, and a sweep folder
holds its records (issue 48: docs/evaluation.md showed a `runs/countdown` command whose records
never existed, docs/performance.md an accuracy table with no records at all)."""

from __future__ import annotations

import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATH = re.compile(r"(?<![\w/.-])runs/[\w.+/-]*[\w+]")


def pages() -> list[str]:
    docs = glob.glob(os.path.join(ROOT, "docs", "*.md"))
    return sorted([*docs, os.path.join(ROOT, "README.md"), *glob.glob(os.path.join(ROOT, "runs", "**", "*.md"), recursive=True)])


def test_every_runs_path_the_docs_name_exists_and_sweeps_hold_records():
    missing = []
    for page in pages():
        with open(page, encoding="utf-8") as f:
            text = f.read()
        for path in sorted(set(PATH.findall(text))):
            full = os.path.join(ROOT, path)
            if not os.path.exists(full):
                missing.append(f"{os.path.relpath(page, ROOT)}: {path}")
            elif os.path.isfile(os.path.join(full, "config.json")) and not os.path.isfile(os.path.join(full, "records.jsonl")):
                missing.append(f"{os.path.relpath(page, ROOT)}: {path} (a sweep without records.jsonl)")
    assert not missing, "paths under runs/ that the docs name but the repository lacks:\n" + "\n".join(missing)


def test_the_kv_compression_accuracy_table_without_records_stays_dropped():
    with open(os.path.join(ROOT, "docs", "performance.md"), encoding="utf-8") as f:
        text = f.read()
    assert "| setting | gsm_symbolic |" not in text
