"""An app served on a free loopback port in a thread, for tests that talk HTTP to it."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def serve_app(app: Any, start_timeout: float = 30.0, header_timeout: float = 10.0) -> Iterator[str]:
    """Run ``app`` (ASGI) with uvicorn for the duration, configured as `metaloom serve` runs it
    (`metaloom.server.http.uvicorn_config`); yields its base URL."""
    import uvicorn

    from metaloom.server.http import uvicorn_config

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn_config(app, "127.0.0.1", port, header_timeout=header_timeout, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout
    try:
        while not server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError(f"the app did not start on port {port}")
            time.sleep(0.02)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
