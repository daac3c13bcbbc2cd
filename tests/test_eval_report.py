"""`metaloom report DIR` (`metaloom.eval.report`): one self-contained HTML file for a fake sweep
(pooled majority-vote and best-of-N records with candidates, greedy, a real step beam search
whose tree trace is on disk): no external resource, model text escaped, a drill-down per
problem, the tree as nested collapsible nodes, figures embedded; bad directories are typed
errors; and headless Chromium renders the page to a real, non-blank PNG of the asked size."""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import stat
from html.parser import HTMLParser
from typing import Any

import pytest

from metaloom.errors import InvalidParameter
from metaloom.eval.records import CONFIG, RECORDS, TRACES, Candidate, Record, Selection
from metaloom.eval.report import build_report, drilldown, write_report
from metaloom.eval.report.cells import TEXT_CAP
from metaloom.eval.report.screenshot import ScreenshotFailed, main, screenshot
from metaloom.eval.report.views import CHOSEN_RIGHT, NO_VOTES, NONE_RIGHT, OUTVOTED, vote_outcome, vote_outcomes
from metaloom.eval.tasks.base import Problem
from metaloom.ledger import Ledger
from metaloom.sampling.params import SamplingParams
from metaloom.search.beam import StepBeamSearch
from metaloom.testing.scripted import ScriptedGenerator, ScriptedStepScorer

XSS = "<script>alert(1)</script>"
LONG = "step " * 1200  # 6000 characters: cut at TEXT_CAP
PROBLEMS = [Problem("p1", "What is 2+3?", "5"), Problem("p2", "What is 4+4?", "8"), Problem("p3", "What is 9-2?", "7"),
            Problem("q&<b>", [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 3*3?"}], "9")]
# per problem: the eight majority-vote samples' answers (None: no answer found)
ANSWERS = {"p1": ["5", "5", "6", "5", "5", None, "5", "4"], "p2": ["8", "9", "8", "8", "9", "8", "8", "8"],
           "p3": ["6", "6", "7", "6", "8", "6", "7", "6"], "q&<b>": ["9", "9", "9", "6", "9", "9", "9", "9"]}
MV, BON, GREEDY, BEAM = "majority_vote@n=8", "best_of_n@n=8", "greedy", "step_beam_search@beam_width=2,n=4"
STRATEGIES = [GREEDY, MV, BON, BEAM]
FLOPS_PER_TOKEN = 2.7e8

# a real step beam search (tests/test_search.py's golden tree): four first steps, b and d kept
BEAM_TABLE = {"Q": ["a\n\n", "b\n\n", "c\n\n", "d\n\n"], "Qb\n\n": ["b1", "b2\n\n"], "Qd\n\n": ["d1", "d2\n\n"],
              "Qb\n\nb2\n\n": ["b2x", "b2y"], "Qd\n\nd2\n\n": ["d2x", "d2y"]}
BEAM_SCORES = {"a": 0.1, "b": 0.9, "c": 0.2, "d": 0.8, "b1": 0.7, "b2": 0.6, "d1": 0.95, "d2": 0.5,
               "b2x": 0.4, "b2y": 0.3, "d2x": 0.35, "d2y": 0.2}


def tree_trace() -> list[dict[str, Any]]:
    search = StepBeamSearch(step_scorer=ScriptedStepScorer(BEAM_SCORES), n=4, beam_width=2,
                            params=SamplingParams(temperature=0.8, max_tokens=64, seed=1))
    result = search.run("Q", ScriptedGenerator(BEAM_TABLE), ledger=Ledger())
    return [e.to_dict() for e in result.trace]


def usage(tokens: int) -> dict[str, Any]:
    return {"input_tokens": 12, "output_tokens": tokens, "forward_passes": tokens, "flops": tokens * FLOPS_PER_TOKEN,
            "seconds": tokens * 0.01}


def candidates(problem: Problem, answers: list[str | None], scores: bool) -> tuple[Candidate, ...]:
    out = []
    for k, a in enumerate(answers):
        text = f"Let me think. {problem.prompt if isinstance(problem.prompt, str) else 'What is 3*3?'} The answer is {a}."
        if problem.id == "p1" and k == 2:
            text += " " + XSS
        if problem.id == "p2" and k == 1:
            text = LONG
        tokens = 10 + 3 * k
        out.append(Candidate(text, tokens, tokens * FLOPS_PER_TOKEN, tokens * 0.01, a, a == problem.reference,
                             round(0.9 - 0.1 * k, 2) if scores else None))
    return tuple(out)


def safe(name: str) -> str:
    return re.sub(r"\W", "_", name)


def records(problem: Problem) -> list[Record]:
    """Greedy, majority vote and best-of-N (pooled, with candidates) and a beam search with a trace."""
    answers = ANSWERS[problem.id]
    ref = problem.reference
    counts = {a: answers.count(a) for a in answers if a is not None}
    voted = max(counts, key=lambda a: counts[a])
    groups = tuple(None if a is None else sorted(counts).index(a) for a in answers)
    mv = candidates(problem, answers, scores=False)
    bon = candidates(problem, answers, scores=True)
    out = [
        Record(problem.id, GREEDY, answers[0], answers[0] == ref, float(answers[0] == ref), f"The answer is {answers[0]}.",
               usage(14), 0.15, error="RemoteError: server answered 500" if problem.id == "p3" else None),
        Record(problem.id, MV, voted, voted == ref, float(voted == ref), next(c.text for c in mv if c.answer == voted),
               usage(sum(c.tokens for c in mv)), 1.2, candidates=mv, shared={"flops": 1e9},
               selection=Selection("majority_vote", groups)),
        Record(problem.id, BON, bon[0].answer, bon[0].correct, float(bon[0].correct), bon[0].text,
               usage(sum(c.tokens for c in bon)), 1.3, stopped_reason="budget" if problem.id == "p2" else None,
               candidates=bon, selection=Selection("best_of_n")),
        Record(problem.id, BEAM, ref, True, 1.0, "d\n\nd1", usage(24), 0.9, trace=f"{TRACES}/{safe(problem.id)}.json"),
    ]
    return out


def make_sweep(out: str, *, trace: bool = True) -> list[Record]:
    """A sweep directory as `metaloom.eval.runner` writes it."""
    os.makedirs(os.path.join(out, TRACES), exist_ok=True)
    config = {"task": {"name": "arith", "size": len(PROBLEMS)}, "setup": {"task": "arith", "model": "default", "seed": 0,
                                                                         "limit": None, "dtype": "float32"},
              "strategies": STRATEGIES, "problems": [p.id for p in PROBLEMS]}
    with open(os.path.join(out, CONFIG), "w") as f:
        json.dump(config, f)
    recs = [r for p in PROBLEMS for r in records(p)]
    events = tree_trace()
    with open(os.path.join(out, RECORDS), "w") as f:
        for r in recs:
            f.write(json.dumps(r.to_dict()) + "\n")
            if r.trace and trace:
                with open(os.path.join(out, r.trace), "w") as t:
                    json.dump(events, t)
    return recs


def point(label: str, k: int | None, acc: float, tokens: float, coverage: float | None = None) -> dict[str, Any]:
    return {"label": label, "k": k, "accuracy": acc, "accuracy_lo": max(0.0, acc - 0.2), "accuracy_hi": min(1.0, acc + 0.15),
            "coverage": coverage, "coverage_lo": None if coverage is None else max(0.0, coverage - 0.2),
            "coverage_hi": None if coverage is None else min(1.0, coverage + 0.1), "output_tokens": tokens,
            "flops": tokens * FLOPS_PER_TOKEN, "seconds": tokens * 0.01, "problems": len(PROBLEMS)}


def fake_analysis(recs: list[Record]) -> dict[str, Any]:
    """The dict `metaloom.eval.analysis.analyze` returns, by hand (the report draws it; it
    does not compute it)."""
    ks = (1, 2, 4, 8)
    votes = {p.id: {MV: {a: ANSWERS[p.id].count(a) for a in ANSWERS[p.id] if a is not None},
                    BON: {a: ANSWERS[p.id].count(a) for a in ANSWERS[p.id] if a is not None}} for p in PROBLEMS}
    return {
        "problems": [p.id for p in PROBLEMS], "strategies": STRATEGIES,
        "curves": [
            {"family": "greedy", "points": [point(GREEDY, None, 0.5, 14)]},
            {"family": "majority_vote", "points": [point(f"majority_vote@n={k}", k, a, 13.5 * k, c)
                                                   for k, a, c in zip(ks, (0.55, 0.6, 0.68, 0.75), (0.55, 0.72, 0.9, 1.0),
                                                                      strict=True)]},
            {"family": "best_of_n", "points": [point(f"best_of_n@n={k}", k, a, 13.5 * k, c)
                                               for k, a, c in zip(ks, (0.5, 0.55, 0.6, 0.62), (0.5, 0.7, 0.88, 1.0),
                                                                  strict=True)]},
            {"family": "step_beam_search", "points": [point(BEAM, None, 1.0, 24)]},
        ],
        "frontier": {"output_tokens": [GREEDY, BEAM], "flops": [GREEDY, BEAM], "seconds": [GREEDY, BEAM]},
        "selection": {"seed": 0, "selection_problems": ["p1", "p2"], "heldout_problems": ["p3", "q&<b>"],
                      "bins": [{"name": "easy", "problems": ["p1", "q&<b>"]}, {"name": "hard", "problems": ["p2", "p3"]}],
                      "probe": "greedy correct or not",
                      "rows": [{"budget_flops": 4e9, "budget": 4e9, "choices": {"easy": GREEDY, "hard": GREEDY}, "accuracy": 0.5,
                                "best_single_choice": GREEDY,
                                "majority_vote": 0.5, "best_of_n": 0.5, "best_single": 0.5, "efficiency_vs_majority": 1.0,
                                "efficiency_vs_best_of_n": 1.0},
                               {"budget_flops": 3e10, "budget": 3e10, "choices": {"easy": GREEDY, "hard": "majority_vote@n=8"},
                                "best_single_choice": "majority_vote@n=8",
                                "accuracy": 0.75, "majority_vote": 0.75, "best_of_n": 0.62, "best_single": 0.75,
                                "efficiency_vs_majority": 1.6, "efficiency_vs_best_of_n": None}]},
        "votes": votes,
    }


@pytest.fixture
def sweep(tmp_path) -> tuple[str, list[Record]]:
    out = str(tmp_path / "sweep")
    return out, make_sweep(out)


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> tuple[str, list[Record], str]:
    """The fake sweep's report, written once for the tests that only read it (figures cost
    seconds)."""
    out = str(tmp_path_factory.mktemp("report") / "sweep")
    recs = make_sweep(out)
    return out, recs, report(out, recs)


def report(out: str, recs: list[Record], **kw: Any) -> str:
    path = write_report(out, analysis=kw.pop("analysis", None) or fake_analysis(recs), problems=kw.pop("problems", PROBLEMS),
                        **kw)
    with open(path, encoding="utf-8") as f:
        return f.read()


class Details(HTMLParser):
    """Each `<details>`'s summary text and the summaries of the details around it."""

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[dict[str, Any]] = []
        self.found: list[dict[str, Any]] = []
        self.in_summary: dict[str, Any] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "details":
            node = {"attrs": dict(attrs), "summary": "", "ancestors": [d["summary"] for d in self.stack]}
            self.stack.append(node)
            self.found.append(node)
        elif tag == "summary" and self.stack:
            self.in_summary = self.stack[-1]

    def handle_endtag(self, tag: str) -> None:
        if tag == "details":
            self.stack.pop()
        elif tag == "summary":
            self.in_summary = None

    def handle_data(self, data: str) -> None:
        if self.in_summary is not None:
            self.in_summary["summary"] += data


def details_of(page: str) -> list[dict[str, Any]]:
    parser = Details()
    parser.feed(page)
    assert not parser.stack, "every <details> is closed"
    return parser.found


# ---------------------------------------------------------------------------------- content


def test_report_is_one_self_contained_file(written) -> None:
    out, _, page = written
    assert os.path.isfile(os.path.join(out, "report.html"))
    assert stat.S_IMODE(os.stat(os.path.join(out, "report.html")).st_mode) == 0o644
    # nothing fetched: no http(s) source, link, stylesheet or import; no script at all
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", page, re.I)
    assert "<link" not in page and "@import" not in page and "url(" not in page
    assert "<script" not in page.lower()
    # the figures are inside: PNG data URIs that decode to PNGs
    uris = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert len(uris) == 4  # accuracy vs costs, coverage, compute-optimal, votes
    assert all(base64.b64decode(u)[:8] == b"\x89PNG\r\n\x1a\n" for u in uris)
    assert not [name for name in os.listdir(out) if name.endswith((".png", ".css", ".js", ".svg"))]


def test_model_text_is_escaped(written) -> None:
    page = written[2]
    assert XSS not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "q&<b>" not in page and "q&amp;&lt;b&gt;" in page  # a problem id is task data: escaped too


def test_header_and_summary(written) -> None:
    page = written[2]
    assert "arith" in page and "default" in page
    assert re.search(r"<dt>problems</dt><dd>4</dd>", page) and re.search(r"<dt>strategies</dt><dd>4 ", page)
    summary = page[page.index('id="summary"'):page.index('id="curves"')]
    rows = re.findall(r"<tr><td class=\"strategy\">(.*?)</td>(.*?)</tr>", summary, re.S)
    assert [name for name, _ in rows] == STRATEGIES
    cells = {name: re.findall(r'<td class="num[^"]*">(.*?)</td>', rest, re.S) for name, rest in rows}
    # accuracy with the analysis's interval, mean tokens, FLOPs in engineering units, peak KV
    # memory, errors, budget stops
    assert cells[MV][0] == '75.0%<span class="interval">[55.0, 90.0]</span>'
    assert cells[GREEDY][2] == "3/4" and cells[GREEDY][7] == "1"  # p3's greedy run failed
    assert cells[GREEDY][6] == "–"  # these records hold no measured peak
    assert cells[BON][8] == "1"  # p2's best-of-N stopped at its budget
    assert cells[GREEDY][3] == "14" and cells[GREEDY][4] == "3.78 GFLOP"
    # seconds are what the runs were charged (the ledger's), not the record's wall time: a pool
    # replayed from another run of the sweep took none
    assert cells[GREEDY][5] == "0.14 s"


def test_every_problem_has_a_drill_down_with_candidates(written) -> None:
    page = written[2]
    problems = [d for d in details_of(page) if d["attrs"].get("class") == "problem"]
    assert [d["summary"].split()[0] for d in problems] == [p.id for p in PROBLEMS]
    assert "What is 9-2?" in page and "system: Be brief." in page  # prompts, chat messages as role: content
    runs = [d for d in details_of(page) if "run" in (d["attrs"].get("class") or "").split()]
    assert len(runs) == len(PROBLEMS) * len(STRATEGIES)
    assert all(len(d["ancestors"]) == 1 for d in runs)  # each run inside its problem
    # every candidate of every pooled record is listed, its text in a scrollable pre
    assert page.count("The answer is 6.") >= 2
    assert page.count('<td style="width:65%"><pre>') == 2 * 8 * len(PROBLEMS)
    # the long candidate is cut and says so
    assert LONG[:TEXT_CAP] in page and LONG not in page
    assert f"cut: {len(LONG) - TEXT_CAP} more characters of {len(LONG)}" in page
    # vote bars: right answers green, wrong red
    assert 'class="fill right"' in page and 'class="fill wrong"' in page
    assert "RemoteError: server answered 500" in page


def test_search_tree_is_nested_collapsible(written) -> None:
    page = written[2]
    nodes = [d for d in details_of(page) if "node" in (d["attrs"].get("class") or "").split()]
    assert len(nodes) == 13 * len(PROBLEMS)  # root + 12 steps per tree, in each problem
    first = nodes[:13]
    by_text = {re.search(r"“(.*?)”", d["summary"]).group(1): d for d in first}
    assert set(by_text) == {"the prompt", "a⏎⏎", "b⏎⏎", "c⏎⏎", "d⏎⏎", "b1", "b2⏎⏎", "d1", "d2⏎⏎", "b2x", "b2y", "d2x", "d2y"}
    # nested: d2x inside d2 inside d inside the root, inside the run inside the problem
    chain = [s.split("“")[-1].rstrip("” \n") for s in by_text["d2x"]["ancestors"][-3:]]
    assert chain == ["the prompt", "d⏎⏎", "d2⏎⏎"]
    # the best path (root, d, d1) is open and marked; d1 is the best node; pruned a shows its state
    best = by_text["d1"]["attrs"]
    assert "isbest" in best["class"] and "open" in best and "★" in by_text["d1"]["summary"]
    assert "onbest" in by_text["d⏎⏎"]["attrs"]["class"] and "open" not in by_text["b⏎⏎"]["attrs"]
    assert "pruned" in by_text["a⏎⏎"]["summary"] and "score 0.950" in by_text["d1"]["summary"]
    # the header of metaloom tree, and the trees' index
    assert "step_beam_search · aggregation last" in page and "13 nodes: 1 root" in page
    assert page.count('href="#p0-s3-t0"') == 1


def test_vote_outcomes_per_strategy(sweep) -> None:
    recs = sweep[1]
    by_problem: dict[str, dict[str, Record]] = {}
    for r in recs:
        by_problem.setdefault(r.problem, {})[r.strategy] = r
    rows = dict(vote_outcomes(fake_analysis(recs), by_problem, STRATEGIES))
    # p3's vote chose 6 while 7 (right) had two votes; best-of-N picked candidate 0 (wrong on p3 only)
    assert rows == {MV: {CHOSEN_RIGHT: 3, OUTVOTED: 1}, BON: {CHOSEN_RIGHT: 3, OUTVOTED: 1}}
    assert vote_outcome({}, set(), None) == NO_VOTES
    assert vote_outcome({"1": 2, "2": 1}, {"3"}, None) == NONE_RIGHT
    assert vote_outcome({"1": 2, "2": 1}, {"1"}, None) == CHOSEN_RIGHT  # no record: the most-voted answer


def test_compute_optimal_table_and_its_reason(written, sweep) -> None:
    page = written[2]
    out, recs = sweep
    section = page[page.index('id="selection"'):page.index('id="votes"')]
    assert "30 GFLOP" in section and "×1.6" in section and "majority_vote@n=8" in section and "easy (2 problems)" in section
    # the pick --select prints: the best single strategy at the largest budget
    assert re.search(r'<b>Pick</b>[^<]*<code>metaloom eval --select</code>[^<]*30 GFLOP\): '
                     r'<span class="strategy">majority_vote@n=8</span>', section)
    analysis = fake_analysis(recs)
    analysis["selection"] = {"rows": [], "reason": "fewer than 4 problems per bin"}
    page = report(out, recs, analysis=analysis)
    assert "No compute-optimal table: fewer than 4 problems per bin" in page
    analysis["selection"] = None
    assert "No compute-optimal table: the analysis made no compute-optimal selection" in report(out, recs, analysis=analysis)


def test_frontier_says_what_it_compared_on_and_what_it_left_out(sweep) -> None:
    """Issue 30: the frontier is over the problems its points share; a point run on other
    problems is listed as not compared (and drawn hollow, tested with the figures)."""
    out, recs = sweep
    analysis = fake_analysis(recs)
    shared = [c for c in analysis["curves"] if c["family"] != "step_beam_search"]
    analysis["compared"] = {"problems": ["p1", "p2", "p3"], "curves": shared, "outside": {BEAM: 2}}
    analysis["frontier"] = {key: ["greedy", "majority_vote@n=8"] for key in ("output_tokens", "flops", "seconds")}
    page = report(out, recs, analysis=analysis)
    section = page[page.index('id="frontier"'):page.index('id="selection"')]
    assert "Compared on the 3 problems that 9 points all ran" in section
    assert re.search(r"Not compared \(run on other problems\):\s*<span class=\"strategy\">"
                     + re.escape(BEAM) + r"</span> \(2 problems\)", section)
    assert "hollow ones (1) on other problems" in page


def test_analysis_computed_when_not_given(sweep) -> None:
    out, recs = sweep
    seen: list[list[Record]] = []

    def analyze(records: list[Record]) -> dict[str, Any]:
        seen.append(records)
        return fake_analysis(records)

    html = build_report(out, analyze=analyze, problems=PROBLEMS)
    assert len(seen) == 1 and sorted(r.key for r in seen[0]) == sorted(r.key for r in recs)
    assert "majority_vote@n=8" in html


def test_with_the_real_analysis(sweep) -> None:
    out, _ = sweep
    with open(write_report(out, problems=PROBLEMS)) as f:  # the default: analyze DIR's records
        page = f.read()
    assert page.count("data:image/png;base64,") >= 3 and "majority_vote@n=2" in page  # subsampled points
    assert 'id="selection"' in page and page.count('<details class="problem"') == len(PROBLEMS)
    assert '<td class="strategy">best_of_n@n=8</td>' in page[page.index('<h2 id="scorers">'):]  # it scores


def test_equal_compute_table(sweep) -> None:
    """Each single-run strategy against each sampling curve: a difference with its interval
    (green when the interval is above 0), or the reason there is none."""
    from metaloom.eval.analysis import analyze

    out, recs = sweep
    analysis = analyze(recs, seed=0, draws=20, bootstrap=50)
    rows = analysis["equal_compute"]
    assert {(r["strategy"], r["family"]) for r in rows} == {(s, f) for s in (GREEDY, BEAM)
                                                            for f in ("majority_vote", "best_of_n")}
    page = build_report(out, analysis=analysis, problems=PROBLEMS)
    table = page[page.index('<h3 id="equal">'):page.index('<h2 id="selection">')]
    assert table.count('<tr><td class="strategy">') == 2 and table.count('<th class="family">') == 2
    fake = fake_analysis(recs)
    fake["equal_compute"] = [
        {"strategy": BEAM, "family": "best_of_n", "problems": 4, "cost": 2.4e9, "accuracy": 1.0, "family_accuracy": 0.6,
         "difference": 0.4, "difference_lo": 0.1, "difference_hi": 0.7, "between": ["best_of_n@n=1", "best_of_n@n=2"],
         "reason": None},
        {"strategy": GREEDY, "family": "best_of_n", "problems": 4, "cost": 1e9, "accuracy": 0.5, "family_accuracy": None,
         "difference": None, "difference_lo": None, "difference_hi": None, "between": None,
         "reason": "below the curve's cheapest point (best_of_n@n=1)"}]
    page = build_report(out, analysis=fake, problems=PROBLEMS)
    table = page[page.index('<h3 id="equal">'):page.index('<h2 id="selection">')]
    assert '<td class="num right">+40.0<div class="interval">[10.0, 70.0]</div>' in table
    assert 'title="best_of_n@n=1 … best_of_n@n=2">curve 60.0%' in table
    assert 'title="below the curve&#39;s cheapest point (best_of_n@n=1)">below the curve&#39;s cheapest point<' in table


def test_scorer_table(sweep) -> None:
    """The scorers section: one row per scoring pooled strategy from the analysis, formatted;
    no section (and no link to it) when no strategy scores its candidates."""
    out, recs = sweep
    fake = fake_analysis(recs)
    fake["scorers"] = [{"strategy": BON, "problems": 4, "mixed": 3, "auroc": 0.6666, "accuracy": 2 / 3,
                        "random": 0.5833}]
    page = build_report(out, analysis=fake, problems=PROBLEMS)
    table = page[page.index('<h2 id="scorers">'):page.index('<h2 id="trees">')]
    assert ('<tr><td class="strategy">best_of_n@n=8</td><td class="num">4</td><td class="num">3</td>\n'
            '      <td class="num">0.67</td><td class="num">66.7%</td><td class="num">58.3%</td></tr>') in table
    assert '<a href="#scorers">' in page
    fake["scorers"] = []
    page = build_report(out, analysis=fake, problems=PROBLEMS)
    assert 'id="scorers"' not in page and '<a href="#scorers">' not in page


def test_costs_a_log_axis_cannot_place_are_left_out_and_said(sweep) -> None:
    out, recs = sweep
    analysis = fake_analysis(recs)
    for curve in analysis["curves"]:
        for p in curve["points"]:
            p["flops"] = 0.0  # a scripted generator counts no FLOPs
    page = report(out, recs, analysis=analysis)
    assert "10 (point, cost) pairs had no positive cost" in page


def test_prompts_from_problems_jsonl_or_said_missing(sweep) -> None:
    out, recs = sweep
    page = write_report(out, analysis=fake_analysis(recs))
    with open(page) as f:
        assert "Prompt not available: task arith could not be rebuilt here" in f.read()
    with open(os.path.join(out, "problems.jsonl"), "w") as f:
        for p in PROBLEMS:
            f.write(json.dumps({"id": p.id, "prompt": p.prompt, "reference": p.reference}) + "\n")
    with open(write_report(out, analysis=fake_analysis(recs))) as f:
        assert "What is 4+4?" in f.read()


def test_missing_trace_costs_only_the_tree(tmp_path) -> None:
    out = str(tmp_path / "sweep")
    recs = make_sweep(out, trace=False)
    page = report(out, recs)
    assert "trace file traces/p1.json not found under traces/" in page
    assert 'class="node' not in page and 'id="trees"' not in page


def test_large_candidate_lists_are_capped(tmp_path, monkeypatch) -> None:
    out = str(tmp_path / "sweep")
    make_sweep(out)
    many = Record("p1", "majority_vote@n=100", "5", True, 1.0, "5", usage(100), 1.0,
                  candidates=tuple(Candidate(f"c{k}", 1, 1.0, 0.0, "5", True) for k in range(100)),
                  selection=Selection("majority_vote", (0,) * 100))
    with open(os.path.join(out, RECORDS), "a") as f:
        f.write(json.dumps(many.to_dict()) + "\n")
    empty = {"curves": [], "frontier": {}, "selection": None, "votes": {}}
    page = build_report(out, analysis=empty, problems=PROBLEMS)
    assert "36 more candidates not shown (first 64 of 100)" in page
    assert "The analysis has no curve points." in page and "No votes" in page
    assert "too many candidates" not in page
    # more candidate text than the page's budget: each candidate's cut shorter, and said
    monkeypatch.setattr(drilldown, "PAGE_TEXT_BUDGET", 128 * 250)  # 64 + 2 x 8 x 4 candidates shown: 250 each
    page = build_report(out, analysis=empty, problems=PROBLEMS)
    assert LONG[:250] + "</pre>" in page and "texts cut at 250 characters" in page and "each shows its first 250" in page
    monkeypatch.setattr(drilldown, "PAGE_TEXT_BUDGET", 1000)  # never below MIN_TEXT_CAP
    assert "texts cut at 200 characters" in build_report(out, analysis=empty, problems=PROBLEMS)


# --------------------------------------------------------------------------------- bad input


def test_not_an_eval_directory_is_a_typed_error(tmp_path) -> None:
    with pytest.raises(InvalidParameter, match="no such directory"):
        write_report(str(tmp_path / "nowhere"), analysis={})
    with pytest.raises(InvalidParameter, match=r"config\.json and records\.jsonl missing"):
        write_report(str(tmp_path), analysis={})
    (tmp_path / CONFIG).write_text("{}")
    with pytest.raises(InvalidParameter, match=r"records\.jsonl missing"):
        write_report(str(tmp_path), analysis={})
    (tmp_path / RECORDS).write_text("")
    with pytest.raises(InvalidParameter, match="holds none yet"):
        write_report(str(tmp_path), analysis={})
    (tmp_path / CONFIG).write_text("[1, 2]")
    with pytest.raises(InvalidParameter, match="a JSON object, not a JSON list"):
        write_report(str(tmp_path), analysis={})
    (tmp_path / CONFIG).write_text("{not json")
    with pytest.raises(InvalidParameter, match="config"):
        write_report(str(tmp_path), analysis={})
    (tmp_path / CONFIG).unlink()
    with pytest.raises(InvalidParameter, match=r"\(config\.json missing\)"):
        write_report(str(tmp_path), analysis={})
    assert not os.path.exists(tmp_path / "report.html")


def test_bad_problems_file_is_a_typed_error(sweep) -> None:
    out, recs = sweep
    with open(os.path.join(out, "problems.jsonl"), "w") as f:
        f.write('{"id": "p1"}\nnot json\n')
    with pytest.raises(InvalidParameter, match=r"problems\.jsonl:2"):
        write_report(out, analysis=fake_analysis(recs))


# -------------------------------------------------------------------------------- screenshot


CHROMIUM = shutil.which("chromium")


def pixels(path: str) -> Any:
    """The PNG as an array (matplotlib's reader: no other image library needed)."""
    import matplotlib.image

    return matplotlib.image.imread(path)


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not on PATH (Debian's chromium package renders the report)")
def test_chromium_renders_the_report_to_a_real_picture(sweep) -> None:
    out, recs = sweep
    report(out, recs)
    png = screenshot(os.path.join(out, "report.html"), os.path.join(out, "shot.png"), width=1100, height=1500)
    image = pixels(png)
    assert image.shape[:2] == (1500, 1100)  # rows, columns: the window asked for
    gray = image[..., :3].mean(axis=2)
    assert gray.std() > 0.05  # not one flat colour: text, tables and figures are drawn
    assert (gray < 0.3).mean() > 0.005  # some dark ink (text) ...
    assert (gray > 0.95).mean() > 0.5  # ... on a mostly white page
    # the module's command: DIR/report.html to DIR/report.png, every section open
    assert main([out, "--height", "900", "--expand"]) == 0
    assert pixels(os.path.join(out, "report.png")).shape[:2] == (900, 1280)
    # by default the whole page, however tall: the expanded one is taller than the closed one
    closed = pixels(screenshot(os.path.join(out, "report.html"), os.path.join(out, "closed.png"))).shape[0]
    assert main([out, "--expand"]) == 0
    assert pixels(os.path.join(out, "report.png")).shape[0] > closed > 900


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not on PATH (Debian's chromium package renders the report)")
def test_screenshot_captures_a_page_taller_than_any_fixed_window(tmp_path) -> None:
    # 5,200 px of page, its last 200 px red: a fixed 1280x3000 window cut it (issue 30)
    page = tmp_path / "tall.html"
    page.write_text('<html><body style="margin:0"><div style="height:5000px;background:#fff">top</div>'
                    '<table style="height:200px;width:100%;background:#f00"><tr><td>end</td></tr></table></body></html>')
    image = pixels(screenshot(str(page), str(tmp_path / "tall.png"), width=800))
    assert image.shape[:2] == (5200, 800)
    bottom = image[-150:, :, :3]
    assert ((bottom[..., 0] > 0.9) & (bottom[..., 1] < 0.1)).mean() > 0.9  # the red end is in the picture
    with pytest.raises(ScreenshotFailed, match="5200 px tall, over the 4000 px"):
        screenshot(str(page), str(tmp_path / "cut.png"), width=800, max_height=4000)


def test_screenshot_window_height_is_the_measured_page() -> None:
    from metaloom.eval.report.screenshot import HEIGHT_ATTRIBUTE, measuring_copy, page_height, window_height

    assert window_height(4309) == 4309  # the whole page
    assert window_height(4309, 900) == 900  # asked for the top only
    assert window_height(0) == 1
    with pytest.raises(ScreenshotFailed, match="not measured"):
        window_height(None)
    with pytest.raises(ScreenshotFailed, match="40000 px tall"):
        window_height(40_000, max_height=32_000)
    with pytest.raises(ScreenshotFailed, match="must be positive"):
        window_height(100, 0)
    copy = measuring_copy("<html><body><p>x</p></body></html>")
    assert copy.index(HEIGHT_ATTRIBUTE) < copy.index("</body>")
    assert page_height(f'<body {HEIGHT_ATTRIBUTE}="4309"><p>&lt;b {HEIGHT_ATTRIBUTE}=1&gt;</p>') == 4309
    assert page_height("<body><p>no script ran</p></body>") is None


def test_screenshot_errors_are_typed(tmp_path, monkeypatch) -> None:
    with pytest.raises(ScreenshotFailed, match="does not exist"):
        screenshot(str(tmp_path / "none.html"), str(tmp_path / "x.png"))
    page = tmp_path / "page.html"
    page.write_text("<p>hi</p>")
    fake = tmp_path / "bin" / "chromium"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho 'cannot open display' >&2\nexit 3\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(fake.parent))
    with pytest.raises(ScreenshotFailed, match=r"exited with status 3 .*cannot open display"):
        screenshot(str(page), str(tmp_path / "x.png"))
    fake.write_text("#!/bin/sh\nexit 0\n")  # succeeds but writes nothing
    with pytest.raises(ScreenshotFailed, match="height was not measured"):
        screenshot(str(page), str(tmp_path / "x.png"))
    with pytest.raises(ScreenshotFailed, match="wrote no screenshot"):
        screenshot(str(page), str(tmp_path / "x.png"), height=500)
    fake.unlink()
    with pytest.raises(ScreenshotFailed, match="no Chromium on PATH"):
        screenshot(str(page), str(tmp_path / "x.png"))
    assert main([str(tmp_path)]) == 1  # no report.html there


def test_long_specs_wrap_at_commas_in_figure_legends() -> None:
    from metaloom.eval.report.figure_layout import wrap_label

    spec = "step_beam_search@n=8,beam_width=4,step_scorer=countdown,final_scorer=countdown,step_tokens=48"
    assert wrap_label(spec).splitlines() == ["step_beam_search@n=8,beam_width=4,", "step_scorer=countdown,",
                                             "final_scorer=countdown,step_tokens=48"]
    assert wrap_label("majority_vote") == "majority_vote"
