"""Render an HTML report to a PNG with headless Chromium, to look at it as a person would (a
test of a page is not the page: overlapping figures, an empty section or unreadable labels
only show in a picture).

``python -m metaloom.eval.report.screenshot DIR`` renders ``DIR/report.html`` to
``DIR/report.png``; ``--expand`` opens every collapsible section first, so the drill-downs
and trees are in the picture too.

The picture holds the whole page: headless Chromium's ``--screenshot`` captures only its
window, so a first pass loads a copy of the page with a one-line script that writes the
document's height into the DOM, read back with ``--dump-dom``, and the second pass opens a
window that tall (a fixed window cut the report mid-table). ``--height`` asks for only the
top of the page instead.

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
# the tallest window rendered (a 30,000 px page takes Chromium ~20 s on 2 cores); a taller page
# is an error that says how tall it is, never a picture silently cut
MAX_HEIGHT = 32_000
HEIGHT_ATTRIBUTE = "data-metaloom-page-height"
# run on load, in the measuring copy only: the page's full height at the window's width
MEASURE_SCRIPT = ('<script>window.addEventListener("load", function () { var d = document.documentElement, '
                  f'b = document.body || d; b.setAttribute("{HEIGHT_ATTRIBUTE}", String(Math.ceil(Math.max(d.scrollHeight, '
                  'd.offsetHeight, b.scrollHeight, b.offsetHeight)))); });</script>')


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


def expand(page: str) -> str:
    """The page with every ``<details>`` open. Model text in the page is escaped
    (``&lt;details``), so only the page's own elements match."""
    return re.sub(r"<details(?![^>]*\bopen\b)", "<details open", page)


def expanded_copy(html_path: str, folder: str) -> str:
    """A copy of the page with every ``<details>`` open (`expand`)."""
    with open(html_path, encoding="utf-8") as f:
        page = f.read()
    path = os.path.join(folder, "expanded.html")
    with open(path, "w", encoding="utf-8") as f:
        f.write(expand(page))
    return path


def measuring_copy(page: str) -> str:
    """The page with `MEASURE_SCRIPT` at its end (after ``</html>`` the parser still puts it in
    the body)."""
    at = page.lower().rfind("</body>")
    return page + MEASURE_SCRIPT if at < 0 else page[:at] + MEASURE_SCRIPT + page[at:]


def page_height(dom: str) -> int | None:
    """The height `MEASURE_SCRIPT` wrote into the dumped DOM, None where it is not there (the
    page's own text is escaped, so it cannot forge the attribute)."""
    found = re.search(HEIGHT_ATTRIBUTE + r'="(\d+)"', dom)
    return int(found.group(1)) if found else None


def window_height(measured: int | None, requested: int | None = None, max_height: int = MAX_HEIGHT) -> int:
    """The window to render: ``requested`` where asked (the top of the page only), else the
    page's ``measured`` height (at least 1 px). Raises `ScreenshotFailed` for a size that is
    not positive, a page not measured, or one taller than ``max_height``."""
    if requested is not None:
        if requested <= 0:
            raise ScreenshotFailed(f"window height {requested}: must be positive")
        return requested
    if measured is None:
        raise ScreenshotFailed("the page's height was not measured (the page's load event never ran)")
    if measured > max_height:
        raise ScreenshotFailed(f"the page is {measured} px tall, over the {max_height} px this renders at once: "
                               "pass a height to capture its top only")
    return max(measured, 1)


def _tail(text: bytes, lines: int = 8) -> str:
    """The end of Chromium's output without its D-Bus noise (a container has no bus)."""
    kept = [line for line in text.decode("utf-8", "replace").splitlines() if line.strip() and "dbus" not in line]
    return "\n".join(kept[-lines:])


def _chromium(browser: str, scratch: str, width: int, height: int, action: str, page: str, html_path: str,
              timeout: float) -> subprocess.CompletedProcess[bytes]:
    """One headless Chromium run over ``page`` (``action``: ``--dump-dom`` or ``--screenshot=...``)."""
    command = [browser, "--headless", "--disable-gpu", "--no-sandbox", "--hide-scrollbars", "--no-first-run",
               "--disable-dev-shm-usage", "--force-device-scale-factor=1", f"--user-data-dir={scratch}/profile",
               f"--window-size={width},{height}", action, "file://" + page]
    try:
        done = subprocess.run(command, capture_output=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as exc:
        raise ScreenshotFailed(f"{browser} did not finish rendering {html_path} within {timeout} s") from exc
    except OSError as exc:
        raise ScreenshotFailed(f"{browser} could not be started: {exc}") from exc
    if done.returncode != 0:
        raise ScreenshotFailed(f"{browser} exited with status {done.returncode} rendering {html_path}: "
                               f"{_tail(done.stdout + done.stderr)}")
    return done


def screenshot(html_path: str, png_path: str, *, width: int = DEFAULT_WIDTH, height: int | None = None,
               timeout: float = 60, expand: bool = False, max_height: int = MAX_HEIGHT) -> str:
    """Render ``html_path`` headless at ``width`` px to ``png_path`` and return ``png_path``:
    the whole page (measured first, see the module; up to ``max_height``), or its top
    ``height`` px where ``height`` is given; at device scale 1, so the PNG is exactly that
    size. ``expand``: open every ``<details>`` first. Raises `ScreenshotFailed` when Chromium
    is missing, exits non-zero, times out, reports no height or writes nothing."""
    if width <= 0 or (height is not None and height <= 0):
        raise ScreenshotFailed(f"window size {width}x{height}: both must be positive")
    if not os.path.isfile(html_path):
        raise ScreenshotFailed(f"no page to render: {html_path} does not exist")
    browser = find_browser()
    png_path = os.path.abspath(png_path)
    with tempfile.TemporaryDirectory(prefix="metaloom-chromium-") as scratch:
        page = expanded_copy(html_path, scratch) if expand else os.path.abspath(html_path)
        if height is None:
            with open(page, encoding="utf-8") as f:
                measured = os.path.join(scratch, "measure.html")
                with open(measured, "w", encoding="utf-8") as g:
                    g.write(measuring_copy(f.read()))
            # the same width as the picture: the height depends on where lines wrap
            dom = _chromium(browser, scratch, width, 800, "--dump-dom", measured, html_path, timeout)
            height = window_height(page_height(dom.stdout.decode("utf-8", "replace")), None, max_height)
        target = os.path.join(scratch, "shot.png")
        done = _chromium(browser, scratch, width, height, f"--screenshot={target}", page, html_path, timeout)
        output = _tail(done.stdout + done.stderr)
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
    parser.add_argument("--height", type=int, default=None,
                        help="capture only the top HEIGHT pixels (default: the whole page)")
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
