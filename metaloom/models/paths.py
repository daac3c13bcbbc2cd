"""Where metaloom keeps what it builds and converts (compiled kernels, converted GGUF folders,
native weights, measured choices), and how a folder there is written so that no reader sees
half of it. The bottom of `metaloom.models`: it imports nothing of the package."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable


def user_cache_dir(sub: str) -> str:
    """``sub`` under metaloom's cache: ``$METALOOM_CACHE``, else ``$XDG_CACHE_HOME/metaloom``,
    else ``~/.cache/metaloom``."""
    base = os.environ.get("METALOOM_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "metaloom")
    return os.path.join(base, sub)


def write_folder(target: str, prefix: str, write: Callable[[str], None]) -> None:
    """``write(tmp)`` into a fresh sibling folder of ``target``, then rename it to ``target``:
    readers see the whole folder or none, a failure leaves nothing, and when another process
    finishes first its folder stays."""
    tmp = tempfile.mkdtemp(prefix=prefix, dir=os.path.dirname(target))
    try:
        write(tmp)
        try:
            os.replace(tmp, target)
        except OSError:  # another process finished first
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
