"""Read an eval sweep's output directory into plain data for the report: ``DIR/config.json``
and ``DIR/records.jsonl`` (`metaloom.eval.records`: `load_sweep`), the prompts and references
(`load_problems`) and the tree-search traces under ``DIR/traces/`` (`read_traces`). All the
report's file reading is here; `metaloom.eval.report.views` and `drilldown` turn what it
reads into the page's sections.

Prompts and references are not in the records: they come from ``problems=`` (the task's
`Problem` objects) or, when the sweep wrote one, ``DIR/problems.jsonl`` (one ``{"id",
"prompt", "reference"}`` a line), or the task the config names, rebuilt; without any of them
the drill-down says the prompt was not recorded.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from metaloom.errors import InvalidParameter
from metaloom.eval.records import CONFIG, RECORDS, TRACES, Record, read_records
from metaloom.search.trace import check_tree, tree_events

PROBLEMS = "problems.jsonl"  # optional: prompts and references, for the drill-down

# one trace file's tree events, or none and why (None: the trace holds no tree, no problem)
TraceTrees = tuple[list[Mapping[str, Any]], str | None]


def mapping(v: Any) -> Mapping[str, Any]:
    """``v`` where it is a JSON object, else {} (a field an older or foreign file lacks)."""
    return v if isinstance(v, Mapping) else {}


@dataclass(frozen=True)
class Sweep:
    """What the directory holds: its config, its records (the last one of each (problem,
    strategy) key: a resumed sweep may have redone one), and where its traces are."""

    out_dir: str
    config: Mapping[str, Any]
    records: list[Record]
    written: float  # records.jsonl's modification time (the sweep's last record)


def load_sweep(out_dir: str) -> Sweep:
    """Read DIR, or raise `InvalidParameter` naming what is missing or unreadable: a report
    of a directory that is not an eval output would be an empty page that looks like a
    sweep that found nothing."""
    if not os.path.isdir(out_dir):
        raise InvalidParameter("dir", out_dir, "an existing `metaloom eval` output directory (no such directory)")
    missing = [name for name in (CONFIG, RECORDS) if not os.path.isfile(os.path.join(out_dir, name))]
    if missing:
        raise InvalidParameter("dir", out_dir, f"a `metaloom eval` output directory ({' and '.join(missing)} missing)")
    config_path = os.path.join(out_dir, CONFIG)
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except (ValueError, OSError) as exc:
        raise InvalidParameter("config", config_path, f"the JSON object `metaloom eval` writes ({exc})") from None
    if not isinstance(config, dict):
        raise InvalidParameter("config", config_path, f"a JSON object, not a JSON {type(config).__name__}")
    records_path = os.path.join(out_dir, RECORDS)
    latest = {r.key: r for r in read_records(records_path)}
    if not latest:
        raise InvalidParameter("dir", out_dir, f"an eval output with at least one record ({RECORDS} holds none yet)")
    return Sweep(out_dir, config, list(latest.values()), os.path.getmtime(records_path))


def _problem_info(p: Any) -> tuple[str, dict[str, Any]]:
    get = p.get if isinstance(p, Mapping) else lambda k: getattr(p, k, None)
    return str(get("id")), {"prompt": get("prompt"), "reference": get("reference")}


def load_problems(sweep: Sweep, problems: Iterable[Any] | None) -> tuple[dict[str, dict[str, Any]], str | None]:
    """id -> {"prompt", "reference"} for the drill-down, and why there are none when there
    are none. From, in turn: ``problems`` (objects with ``id``, ``prompt``, ``reference``,
    e.g. `metaloom.eval.tasks.base.Problem`, or dicts); ``DIR/problems.jsonl``; the task the
    config names, rebuilt (`metaloom.eval.tasks.make_task`) when its config is the recorded one."""
    if problems is not None:
        return dict(_problem_info(p) for p in problems), None
    path = os.path.join(sweep.out_dir, PROBLEMS)
    if os.path.isfile(path):
        out: dict[str, dict[str, Any]] = {}
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    try:
                        pid, info = _problem_info(json.loads(line))
                    except (ValueError, TypeError, AttributeError) as exc:
                        raise InvalidParameter("problems", f"{path}:{number}", f'a JSON object with an "id" ({exc})') from None
                    out[pid] = info
        return out, None
    return task_problems(sweep.config)


def task_problems(config: Mapping[str, Any]) -> tuple[dict[str, dict[str, Any]], str | None]:
    """The problems of the task ``config`` names, rebuilt as the sweep built them, or none and
    why. Best effort: a task that cannot be rebuilt here (an unknown name, a dataset not on
    this machine, a file moved) costs the page its prompts, not the page."""
    setup = mapping(config.get("setup"))
    name = setup.get("task")
    if not isinstance(name, str):
        return {}, "config.json names no task to read the prompts from"
    try:
        from metaloom.eval.tasks import make_task  # type: ignore[attr-defined,unused-ignore]

        task = make_task(name, limit=setup.get("limit"), seed=setup.get("seed", 0))
        if config.get("task") is not None and task.config() != config.get("task"):
            return {}, f"task {name} today is not the task the sweep ran (its config differs)"
        return dict(_problem_info(p) for p in task.problems()), None
    except Exception as exc:  # any failure of someone else's task code only costs the prompts
        return {}, f"task {name} could not be rebuilt here ({type(exc).__name__}: {exc})"


# --------------------------------------------------------------------------------- traces


def read_trace(out_dir: str, name: str) -> TraceTrees:
    """The tree events of one trace file, or none and why (a missing or unreadable trace
    costs its record the tree, not the whole report)."""
    candidates = [name] if os.path.isabs(name) else [os.path.join(out_dir, name), os.path.join(out_dir, TRACES, name)]
    path = next((p for p in candidates if os.path.isfile(p)), None)
    if path is None:
        return [], f"trace file {name} not found under {TRACES}/"
    try:
        with open(path, encoding="utf-8") as f:
            events = json.load(f)
    except (ValueError, OSError) as exc:
        return [], f"trace file {name} is not readable JSON ({exc})"
    trees = tree_events({"trace": events} if isinstance(events, list) else events)
    if not trees:
        return [], None
    bad = []
    for k, tree in enumerate(trees):
        try:
            check_tree(tree, name, f"tree {k + 1}" if len(trees) > 1 else "")
        except InvalidParameter as exc:
            bad.append(str(exc))
    return ([], "; ".join(bad)) if bad else (trees, None)


def read_traces(out_dir: str, records: Iterable[Record]) -> dict[str, TraceTrees]:
    """`read_trace` of each trace file the records name, by its name."""
    out: dict[str, TraceTrees] = {}
    for r in records:
        if r.trace and r.trace not in out:
            out[r.trace] = read_trace(out_dir, r.trace)
    return out


# --------------------------------------------------------------------------------- merging


def model_tag(config: Mapping[str, Any]) -> str:
    """A sweep's model as a short tag: the file or folder name without ``.gguf``."""
    model = str(mapping(config.get("setup")).get("model") or "?")
    name = os.path.basename(model.rstrip("/")) or model
    return name[:-5] if name.endswith(".gguf") else name


def _tagged(spec: str, tag: str) -> str:
    from metaloom.wiring.spec import Spec, parse_spec

    s = parse_spec(spec)
    return Spec(s.name, {**s.params, "model": tag}, s.groups).text()


def merge_sweeps(sweeps: list[Sweep]) -> Sweep:
    """Several sweeps of one task (the same problems) as one, to compare them in one report: a
    small model's searches against a larger model's votes at equal FLOPs. Where the models
    differ, every strategy is labelled with its sweep's model (``greedy@model=qwen2.5-coder-1.5b``:
    a label, read by the analysis as the strategy with one more parameter, not a spec to run),
    so each model's sampling strategies are curves of their own. Trace paths become absolute
    (each sweep keeps its own ``traces/``). Another task, or the same (problem, strategy) in
    two sweeps: `InvalidParameter` naming the directory."""
    first = sweeps[0]
    tags = [model_tag(s.config) for s in sweeps]
    label = len(set(tags)) > 1
    records: list[Record] = []
    seen: set[tuple[str, str]] = set()
    strategies: list[str] = []
    for sweep, tag in zip(sweeps, tags, strict=True):
        if sweep.config.get("task") != first.config.get("task"):
            raise InvalidParameter("with", sweep.out_dir, f"a sweep of the same task as {first.out_dir} "
                                   "(its config.json's task differs)")
        for r in sweep.records:
            strategy = _tagged(r.strategy, tag) if label else r.strategy
            if (r.problem, strategy) in seen:
                raise InvalidParameter("with", sweep.out_dir, f"sweeps without a strategy in common ({r.strategy!r} "
                                       f"on {r.problem} is in two of them, same model)")
            seen.add((r.problem, strategy))
            trace = os.path.abspath(os.path.join(sweep.out_dir, r.trace)) if r.trace else None
            records.append(replace(r, strategy=strategy, trace=trace))
        strategies += [_tagged(s, tag) if label else str(s) for s in sweep.config.get("strategies") or ()]
    setup = {**mapping(first.config.get("setup")), "model": " + ".join(dict.fromkeys(
        str(mapping(s.config.get("setup")).get("model")) for s in sweeps))}
    problems = list(dict.fromkeys(str(p) for s in sweeps for p in s.config.get("problems") or ()))
    config = {**first.config, "setup": setup, "strategies": strategies, "problems": problems,
              "merged": [{"dir": s.out_dir, "model": mapping(s.config.get("setup")).get("model")} for s in sweeps]}
    return Sweep(first.out_dir, config, records, max(s.written for s in sweeps))


def without(sweep: Sweep, exclude: Sequence[str]) -> Sweep:
    """``sweep`` without the strategies whose spec contains any of ``exclude``'s texts (records
    and the config's strategy list); nothing left: `InvalidParameter`."""
    def kept(spec: str) -> bool:
        return not any(text in spec for text in exclude)

    records = [r for r in sweep.records if kept(r.strategy)]
    if not records:
        raise InvalidParameter("exclude", list(exclude), "texts that leave some strategy of the sweep")
    config = {**sweep.config, "strategies": [s for s in sweep.config.get("strategies") or () if kept(str(s))]}
    return replace(sweep, config=config, records=records)
