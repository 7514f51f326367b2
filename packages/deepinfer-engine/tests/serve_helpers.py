"""Serving an app on 127.0.0.1 for the server tests."""

from __future__ import annotations

import socket
import threading
import time

import uvicorn


def start_uvicorn(app: object, timeout_s: float = 30.0) -> tuple[str, uvicorn.Server, threading.Thread]:
    """Serve `app` on a free port of 127.0.0.1 in a daemon thread (the socket is bound before uvicorn
    starts); returns (base URL, server, thread) once the server accepts requests."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.01)
    return f"http://127.0.0.1:{sock.getsockname()[1]}", server, thread
