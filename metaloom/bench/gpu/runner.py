"""One run of `metaloom bench gpu`: shape by shape (built, its cases, freed), each case a cell
of systems timed side by side — a warm-up call each, then ``--repeats`` rounds alternating
them while the next call fits the budget — its rows appended to the report, and the report
saved after every cell, so a run cut short keeps what it measured."""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from metaloom.bench import gpu_worker as gw
from metaloom.bench.gpu.args import Options, ShapeRun
from metaloom.bench.gpu.baseline import BaselineFailed, BaselineWorker
from metaloom.bench.gpu.budget import Budget, Estimator
from metaloom.bench.gpu.calls import (
    CallResult,
    Shape,
    TokenCountError,
    baseline_caller,
    build_shape,
    checked,
    error_text,
    free_shape,
    metaloom_caller,
    transformers_caller,
)
from metaloom.bench.gpu.cases import (
    CASES,
    METALOOM_MODES,
    NO_SPECULATION,
    ROW_NAMES,
    SYSTEMS,
    TRANSFORMERS,
    Case,
    graphs_rows,
    transformers_compiles,
)
from metaloom.bench.gpu.report import compare, fill, join_note, new_row, ratios, spec_note


@dataclass
class Runner:
    """One benchmark run: the device, the options, the budget, the baseline worker and the report."""

    opts: Options
    device: str
    folder: str
    vocab: int
    budget: Budget
    estimator: Estimator
    report: dict[str, Any]
    cases: Mapping[str, Case]
    out: str | None
    log: Callable[[str], None]
    baseline: BaselineWorker | None = None
    baseline_error: str | None = None
    baseline_shape: str | None = None
    graph_counts: dict[str, dict[str, int]] = field(default_factory=dict)  # per system, over the current cell

    def save(self) -> None:
        self.report["elapsed_s"] = self.budget.elapsed()
        if self.out:
            tmp = self.out + ".tmp"
            with open(tmp, "w") as f:
                json.dump(self.report, f, indent=1)
            os.replace(tmp, self.out)

    def skip_row(self, shape: str, case: Case, system: str, why: str) -> None:
        self.report["rows"].append(new_row(shape, case, system) | {"error": why})

    # --- shapes ------------------------------------------------------------------------------------------
    def run_shape(self, spec: ShapeRun) -> None:
        """``spec``'s shape built (unless it does not fit the budget or fails: its rows say why),
        its cases run in order, the shape freed, its ratios computed."""
        shape = self._build(spec)
        if shape is not None:
            try:
                for c in spec.cases:
                    self.log(f"{spec.shape} {c}: {self.cases[c].label}")
                    self.run_cell(shape, self.cases[c], self._systems_for(c))
            finally:
                free_shape(shape, self.device)
                self._free_baseline(spec.shape)
            ratios(self.report, spec.shape)
        self.save()

    def _build(self, spec: ShapeRun) -> Shape | None:
        """The shape built and its figures in the report; None, each of its rows skipped with the
        reason, when building it and its first cell would not fit the budget or building failed."""
        cfg = gw.hf_config(spec.shape, self.vocab)
        guess, prior = self.estimator.build(cfg)
        first = self.cases[spec.cases[0]]
        cheapest = min(self.estimator.call(s, cfg, first)[0]
                       for s in self._systems_for(first.name) or self.opts.systems) * (1 + self.opts.repeats)
        if not self.budget.fits(guess + cheapest):
            self._skip_shape(spec, f"time budget: the shape takes ~{guess:.0f} s to build and ~{cheapest:.0f} s for "
                                   f"its first cell, {self.budget.left():.0f} s left")
            self.log(f"{spec.shape}: skipped (time budget)")
            return None
        self.log(f"{spec.shape}: building ({gw.parameter_count(cfg) / 1e6:,.1f}M parameters)")
        try:
            shape = build_shape(spec.shape, self.vocab, self.device, self.opts.dtype, self.opts.seed, self.folder,
                                self.cases)
        except Exception as exc:  # out of memory, a transformers that cannot build it: the shape's rows say so
            gw.free_device_memory(self.device)
            self._skip_shape(spec, f"building the shape failed: {error_text(exc)}")
            self.log(f"{spec.shape}: building failed: {error_text(exc)}")
            return None
        self.estimator.observe("build", prior, shape.build_s)
        info = self.report["shapes"].setdefault(spec.shape, {})
        info |= {"config": cfg, "parameters": gw.parameter_count(cfg), "step_weight_bytes": self.weight_bytes(cfg),
                 "build_s": shape.build_s, "checksum": shape.checksum}
        self.log(f"{spec.shape}: built in {shape.build_s:.1f} s")
        return shape

    def _skip_shape(self, spec: ShapeRun, why: str) -> None:
        for c in spec.cases:
            for system in self._systems_for(c):
                self.skip_row(spec.shape, self.cases[c], system, why)

    def weight_bytes(self, cfg: Mapping[str, Any]) -> int:
        """Weight bytes one batch-1 step reads, in this run's dtype."""
        import torch

        return gw.step_weight_bytes(cfg, getattr(torch, self.opts.dtype).itemsize)

    def _systems_for(self, case: str) -> list[str]:
        """The rows of ``case``: the chosen systems; for a speculative case metaloom's only, and
        the same engine without speculation (graphs on, else off) as a reference."""
        o = self.opts
        if CASES[case].speculative:
            engines = [s for s in o.systems if s in NO_SPECULATION]
            return [*engines, NO_SPECULATION[engines[0]]] if engines else []
        return [s for s in o.systems if (s != "baseline" or case in o.baseline_cases)
                and (s != "tf-static" or case in o.static_cases)]

    # --- the baseline worker -------------------------------------------------------------------------------
    def ensure_baseline(self, shape: Shape) -> None:
        """The worker started, checked and holding ``shape`` (`BaselineFailed` if it cannot)."""
        if self.baseline_error is not None:
            raise BaselineFailed(self.baseline_error)
        assert self.baseline is not None
        try:
            if not self.baseline.checked:
                self.report["baseline"]["metaloom"] = self.baseline.hello(timeout_s=max(30.0, min(180.0, self.budget.left())))
            if self.baseline_shape != shape.name:
                est, prior = self.estimator.build(shape.cfg)
                if not self.budget.fits(est):
                    raise BaselineFailed(f"time budget: building the shape takes ~{est:.0f} s, {self.budget.left():.0f} s left")
                reply = self.baseline.request({"op": "build", "config": shape.cfg, "seed": self.opts.seed, "device": self.device,
                                               "dtype": self.opts.dtype, "tokenizer": self.folder,
                                               "cases": {c.name: c.spec() for c in self.cases.values()}},
                                              timeout_s=max(60.0, 10 * est))
                self.estimator.observe("build", prior, float(reply["build_s"]))
                self.baseline_shape = shape.name
                same = reply["checksum"] == shape.checksum
                self.report["shapes"][shape.name]["baseline_build_s"] = reply["build_s"]
                self.report["shapes"][shape.name]["baseline_same_weights"] = same
                if not same:
                    self.log(f"  baseline weights differ (checksum {reply['checksum']} vs {shape.checksum})")
        except BaselineFailed as exc:
            if not str(exc).startswith("time budget"):
                self.baseline_error = str(exc)
                self.baseline.kill()
            raise

    def _free_baseline(self, shape: str) -> None:
        if self.baseline is not None and self.baseline_shape == shape:
            self.baseline_shape = None
            try:
                self.baseline.request({"op": "free"}, 60)
            except BaselineFailed as exc:
                self.baseline_error = str(exc)

    # --- cells ---------------------------------------------------------------------------------------------
    def run_cell(self, shape: Shape, case: Case, systems: Sequence[str]) -> None:
        """``systems`` on one case, rows appended: first those that do not compile (a warm-up
        each, then alternating timed rounds), saved; then a compiling transformers static on its
        own (its compilation, a second warm-up, its rounds), so a compilation that runs long
        cannot cost the other rows their timed rounds."""
        compiling = [s for s in systems if s == "tf-static" and transformers_compiles(self.device)]
        rows: dict[str, dict[str, Any]] = {}
        self.graph_counts = {}
        for group in ([s for s in systems if s not in compiling], compiling):
            if not group:
                continue
            measured = self._measure(shape, case, group)
            if group is compiling:
                for row in measured.values():
                    row["note"] = join_note(row.get("note"), "timed after the other rows, not alternated with them")
            rows |= measured
            self.report["rows"] += list(measured.values())
            compare(rows, case, shape, self.graph_counts, self.device)
            for row in measured.values():
                if row.get("tok_s"):
                    self.log(f"  {row['system']:<20} {row['tok_s']:9.1f} tok/s  step {row['step_ms']:.2f} ms"
                             + (f"  {100 * row['bandwidth_fraction']:.0f}% of copy bandwidth"
                                if row.get("bandwidth_fraction") else "")
                             + (f"  {spec_note(row)}" if row.get("forward_passes") is not None else ""))
            self.save()

    def caller(self, system: str, shape: Shape, case: Case, static_compile: list[bool]) -> Callable[[], CallResult]:
        """``system``'s one call on ``case`` (its graph counters kept over the cell)."""
        if system in METALOOM_MODES:
            return metaloom_caller(system, shape, case, self.device, self.graph_counts.setdefault(system, {}))
        if system in TRANSFORMERS:
            return transformers_caller(system, shape, case, self.device, static_compile)
        assert system == "baseline" and self.baseline is not None
        return baseline_caller(self.baseline, case, max(120.0, 20 * self.estimator.call(system, shape.cfg, case)[0]))

    def _measure(self, shape: Shape, case: Case, systems: Sequence[str]) -> dict[str, dict[str, Any]]:
        """A warm-up of each system that fits the budget, then ``repeats`` rounds alternating them
        while the next call fits; {system: row}."""
        rows: dict[str, dict[str, Any]] = {}
        calls: dict[str, Callable[[], CallResult]] = {}
        priors: dict[str, float] = {}
        for system in systems:
            rows[system] = new_row(shape.name, case, system)
            warm = self._warm_up(rows[system], shape, case, system)
            if warm is not None:
                calls[system], priors[system] = warm
        results = self._rounds(case, calls, rows)
        for system, row in rows.items():
            done = results.get(system, [])
            if done and not row.get("error"):
                fill(row, done, case, self.weight_bytes(shape.cfg), self.report["device"]["copy_bandwidth_gb_s"])
                self.estimator.observe(system, priors[system], row["median_s"])
            elif not row.get("error"):
                row["error"] = "time budget: no timed round fitted"
        return rows

    def _warm_up(self, row: dict[str, Any], shape: Shape, case: Case,
                 system: str) -> tuple[Callable[[], CallResult], float] | None:
        """``system``'s warm-up call (a compiling transformers static's first call included), when
        it and its rounds fit the budget: its call and the prior of its estimate; else None and
        the row's error says why."""
        if system == "graphs-mixed" and case.n <= graphs_rows():
            row["error"] = f"the same step as graphs at {case.n} rows (Triton's step up to {graphs_rows()})"
            return None
        guess, prior = self.estimator.call(system, shape.cfg, case)
        compiling = system == "tf-static" and transformers_compiles(self.device)
        static_compile = [compiling]
        if not self._affordable(row, system, guess * (1 + self.opts.repeats), compiling):
            return None
        try:
            if system == "baseline":
                self.ensure_baseline(shape)
            call = self.caller(system, shape, case, static_compile)
            if compiling:
                self._compile(row, call, case, static_compile, shape)
            elif system == "tf-static":
                row["compiled"] = False
                row["note"] = f"not compiled on {self.device} (transformers compiles on CUDA)"
            start = time.monotonic()
            first = checked(call(), case)
            row["warmup_s"] = time.monotonic() - start
            row["warmup_call_s"] = first.seconds
            return call, prior
        except (TokenCountError, BaselineFailed) as exc:
            row["error"] = str(exc)
        except Exception as exc:  # a system failing is its row's result, not the run's end
            row["error"] = error_text(exc)
            gw.free_device_memory(self.device)
        self.log(f"  {ROW_NAMES[system]}: {row['error']}")
        return None

    def _affordable(self, row: dict[str, Any], system: str, cost: float, compiling: bool) -> bool:
        """Whether a system's calls (``cost`` seconds) and, ``compiling``, its compilation fit the
        budget (compilations: at most ``compile_share`` of it); if not, the row's error says why."""
        o = self.opts
        if compiling:
            compile_guess = self.estimator.compile()
            share_left = o.compile_share * o.budget_s - self.budget.compile_spent_s
            if compile_guess > share_left or not self.budget.fits(cost + compile_guess):
                row["error"] = (f"time budget: compiling takes ~{compile_guess:.0f} s, {self.budget.left():.0f} s left "
                                f"({max(0.0, share_left):.0f} s of them for compiling)")
                self.log(f"  {ROW_NAMES[system]}: {row['error']}")
                return False
            cost += compile_guess
        if not self.budget.fits(cost):
            row["error"] = f"time budget: ~{cost:.0f} s needed, {self.budget.left():.0f} s left"
            self.log(f"  {ROW_NAMES[system]}: {row['error']}")
            return False
        return True

    def _rounds(self, case: Case, calls: dict[str, Callable[[], CallResult]],
                rows: dict[str, dict[str, Any]]) -> dict[str, list[CallResult]]:
        """``repeats`` rounds, each calling the systems of ``calls`` in turn; a system leaves when
        its next call would not fit the budget (its row's note says after how many rounds) or
        when a call fails (its row's error)."""
        results: dict[str, list[CallResult]] = {system: [] for system in calls}
        for r in range(self.opts.repeats):
            for system, call in list(calls.items()):
                done = results[system]
                guess = statistics.median(x.seconds for x in done) if done else rows[system]["warmup_s"]
                if not self.budget.fits(guess):
                    rows[system]["note"] = join_note(rows[system].get("note"),
                                                     f"time budget: {r} of {self.opts.repeats} rounds")
                    del calls[system]
                    continue
                try:
                    done.append(checked(call(), case))
                except (TokenCountError, BaselineFailed) as exc:
                    rows[system]["error"] = str(exc)
                    del calls[system]
                except Exception as exc:
                    rows[system]["error"] = error_text(exc)
                    del calls[system]
                    gw.free_device_memory(self.device)
        return results

    def _compile(self, row: dict[str, Any], call: Callable[[], CallResult], case: Case, static_compile: list[bool],
                 shape: Shape) -> None:
        """transformers static's first call, which compiles; when compiling fails, the row's note
        says why and ``static_compile`` turns compiling off for its other calls."""
        row["compiled"] = True
        shape.compiled = True  # dynamo holds state for this model (also after a failure): reset with the shape
        self.log(f"  {SYSTEMS['tf-static']}: compiling (first call)")
        start = time.monotonic()
        try:
            checked(call(), case)
        except TokenCountError:
            raise
        except Exception as exc:  # torch.compile's many error types: the row says which
            row["compiled"] = False
            row["note"] = f"torch.compile failed ({error_text(exc)}); measured without compiling"
            static_compile[0] = False
            gw.free_device_memory(self.device)
        finally:
            spent = time.monotonic() - start
            self.budget.compile_spent_s += spent
            row["compile_warmup_s"] = spent
            self.estimator.observe("compile", self.opts.compile_s, spent)
        self.log(f"  {SYSTEMS['tf-static']}: first call {spent:.1f} s" + ("" if row["compiled"] else f"; {row['note']}"))
