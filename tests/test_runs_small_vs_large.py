"""runs/small_vs_large/report.py: the report of two sweeps is written from copies restricted to the
problems every strategy of both finished (issue 49's small-vs-large page must agree with
`runs/results_tables.py small_vs_large`, which reads those problems only)."""

from __future__ import annotations

import importlib.util
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _script():
    path = os.path.join(ROOT, "runs", "small_vs_large", "report.py")
    spec = importlib.util.spec_from_file_location("small_vs_large_report", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _sweep(folder, problems, records):
    os.makedirs(os.path.join(folder, "traces"))
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({"task": {"task": "game24"}, "setup": {"model": "m.gguf"}, "strategies": ["greedy"], "problems": problems}, f)
    with open(os.path.join(folder, "records.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)


def test_restricted_copy_keeps_only_the_given_problems_and_links_the_traces(tmp_path):
    src = str(tmp_path / "game24")
    problems = ["game24/0", "game24/1", "game24/2"]
    _sweep(src, problems, [{"problem": p, "strategy": "greedy", "correct": i == 0} for i, p in enumerate(problems)])
    os.utime(os.path.join(src, "records.jsonl"), (1000, 1000))
    out = _script().restricted_copy(src, {"game24/0", "game24/2"}, str(tmp_path / "copies"))
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["problems"] == ["game24/0", "game24/2"]
    with open(os.path.join(out, "records.jsonl")) as f:
        assert [json.loads(line)["problem"] for line in f] == ["game24/0", "game24/2"]
    assert os.path.getmtime(os.path.join(out, "records.jsonl")) == 1000
    assert os.path.realpath(os.path.join(out, "traces")) == os.path.realpath(os.path.join(src, "traces"))
