"""`metaloom report DIR`: one self-contained HTML file for an eval sweep (`build.write_report`),
its figures (`figures`, laid out by `figure_layout`), and a headless-Chromium screenshot of it
(`screenshot`, also ``python -m metaloom.eval.report.screenshot DIR``) to look at it as a person
would."""

from metaloom.eval.report.build import build_report, write_report

__all__ = ["build_report", "write_report"]
