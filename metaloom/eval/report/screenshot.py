"""Render an HTML report to a PNG with headless Chromium, to look at it as a person would (a
test of a page is not the page: overlapping figures, an empty section or unreadable labels
only show in a picture).

``python -m metaloom.eval.report.screenshot DIR`` renders ``DIR/report.html`` to
``DIR/report.png``; ``--expand`` opens every collapsible section first, so the drill-downs
and trees are in the picture too.

Chromium is Debian's ``chromium`` package (or ``chromium-browser``/``google-chrome`` where
that is what is installed). Each run gets a fresh temporary profile, so two screenshots at
once do not fight over one profile's lock.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

from metaloom.errors import MetaloomError

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
DEFAULT_WIDTH = 1280
DEFAULT_HEIGHT = 3000


class ScreenshotFailed(MetaloomError):
    """Chromium is missing, failed, timed out or wrote no picture; the message says which
    (with the end of what Chromium printed)."""


def find_browser() -> str:
    """The first Chromium on PATH, or `ScreenshotFailed` saying none is installed."""
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    raise ScreenshotFailed(f"no Chromium on PATH (looked for {', '.join(BROWSERS)}): install Debian's chromium package")


def expanded_copy(html_path: str, folder: str) -> str:
    """A copy of the page with every ``<details>`` open. Model text in the page is escaped
    (``&lt;details``), so only the page's own elements match."""
    with open(html_path, encoding="utf-8") as f:
        page = f.read()
    page = re.sub(r"<details(?![^>]*\bopen\b)", "<details open", page)
    path = os.path.join(folder, "expanded.html")
    with open(path, "w", encoding="utf-8") as f:
        f.write(page)
    return path


def _tail(text: bytes, lines: int = 8) -> str:
    """The end of Chromium's output without its D-Bus noise (a container has no bus)."""
    kept = [line for line in text.decode("utf-8", "replace").splitlines() if line.strip() and "dbus" not in line]
    return "\n".join(kept[-lines:])


def screenshot(html_path: str, png_path: str, *, width: int = DEFAULT_WIDTH, height: int = DEFAULT_HEIGHT,
               timeout: float = 60, expand: bool = False) -> str:
    """Render ``html_path`` in a ``width`` x ``height`` headless window to ``png_path`` (the
    window's top ``height`` pixels of the page, at device scale 1, so the PNG is exactly that
    size) and return ``png_path``. ``expand``: open every ``<details>`` first. Raises
    `ScreenshotFailed` when Chromium is missing, exits non-zero, times out or writes nothing."""
    if width <= 0 or height <= 0:
        raise ScreenshotFailed(f"window size {width}x{height}: both must be positive")
    if not os.path.isfile(html_path):
        raise ScreenshotFailed(f"no page to render: {html_path} does not exist")
    browser = find_browser()
    png_path = os.path.abspath(png_path)
    with tempfile.TemporaryDirectory(prefix="metaloom-chromium-") as scratch:
        page = expanded_copy(html_path, scratch) if expand else os.path.abspath(html_path)
        target = os.path.join(scratch, "shot.png")
        command = [browser, "--headless", "--disable-gpu", "--no-sandbox", "--hide-scrollbars", "--no-first-run",
                   "--disable-dev-shm-usage", "--force-device-scale-factor=1", f"--user-data-dir={scratch}/profile",
                   f"--window-size={width},{height}", f"--screenshot={target}", "file://" + page]
        try:
            done = subprocess.run(command, capture_output=True, timeout=timeout, check=False)
        except subprocess.TimeoutExpired as exc:
            raise ScreenshotFailed(f"{browser} did not finish rendering {html_path} within {timeout} s") from exc
        except OSError as exc:
            raise ScreenshotFailed(f"{browser} could not be started: {exc}") from exc
        output = _tail(done.stdout + done.stderr)
        if done.returncode != 0:
            raise ScreenshotFailed(f"{browser} exited with status {done.returncode} rendering {html_path}: {output}")
        if not os.path.isfile(target) or os.path.getsize(target) == 0:
            raise ScreenshotFailed(f"{browser} wrote no screenshot of {html_path}: {output}")
        os.makedirs(os.path.dirname(png_path), exist_ok=True)
        shutil.move(target, png_path)
    return png_path


def main(argv: list[str] | None = None) -> int:
    """``python -m metaloom.eval.report.screenshot DIR``: DIR/report.html to DIR/report.png."""
    parser = argparse.ArgumentParser(prog="python -m metaloom.eval.report.screenshot",
                                     description="render an eval report (DIR/report.html) to a PNG with headless Chromium")
    parser.add_argument("dir", help="the eval output directory holding report.html (or the path of an HTML file)")
    parser.add_argument("--out", default=None, help="the PNG to write (default: report.png beside the page)")
    parser.add_argument("--width", type=int, default=DEFAULT_WIDTH, help="window width in pixels")
    parser.add_argument("--height", type=int, default=DEFAULT_HEIGHT, help="window height in pixels (what is captured)")
    parser.add_argument("--timeout", type=float, default=60, help="seconds Chromium may take")
    parser.add_argument("--expand", action="store_true", help="open every collapsible section before rendering")
    args = parser.parse_args(argv)
    html = args.dir if os.path.isfile(args.dir) else os.path.join(args.dir, "report.html")
    out = args.out or os.path.join(os.path.dirname(html), "report.png")
    try:
        print(screenshot(html, out, width=args.width, height=args.height, timeout=args.timeout, expand=args.expand))
    except MetaloomError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
