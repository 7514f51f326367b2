"""`HttpPrefillClient`: the decode server's `kv_handoff.KVTransfer`, a client of a prefill server
(`deepinfer serve --pd-role prefill`, `prefill_side`, `serve.pd_routes`).

At start (`connect`) it reads the prefill server's fingerprint (GET /v1/pd/info; a server not up yet
is waited for a while) and refuses another model, naming both, or a server that refuses its API key
(401: every request carries `Authorization: Bearer <api_key>` when one is given; the key itself is
never put in a message or log). Each prefill order is one POST
/v1/pd/prefill on a connection of its own, run by a worker thread: the answer is the handoff's frames
(`framing`), or an error naming why; either ends up in the queue `poll` reads. `cancel` shuts the
order's socket, which cuts the transfer there and tells the prefill server the request is gone.
Nothing is retried: a refused connection, a cut transfer or a prefill server that restarted fails
the orders in flight with that said, and the next order connects afresh."""

from __future__ import annotations

import http.client
import json
import queue
import socket
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor

from ..core.kv_handoff import ModelFingerprint, PrefilledRequest, PrefillOrder, TransferFailed
from ..core.stats import TransferStats
from .framing import order_json, read_handoff

CONNECT_TIMEOUT_S = 10.0     # the start-up handshake, and reaching the server for an order
MAX_ORDERS_IN_FLIGHT = 64    # worker threads (orders beyond wait for one)


class HttpPrefillClient:
    """The decode side of a prefill/decode pair over HTTP (module docstring).

    Args:
        url: the prefill server, "http://HOST:PORT".
        timeout_s: the longest a prefill may stay silent (queueing and prefill included) before its
            order fails.
        start_wait_s: how long `connect` waits for a prefill server that is not listening yet.
        api_key: the prefill server's `--api-key`, sent with every request; None = no header.

    Raises:
        ValueError: a URL that is not http://HOST:PORT, or an api_key `check_api_key` refuses.
    """

    prefills = True

    def __init__(self, url: str, *, timeout_s: float = 600.0, start_wait_s: float = 60.0,
                 api_key: str | None = None) -> None:
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme != "http" or not parsed.hostname or parsed.path not in ("", "/"):
            raise ValueError(f"pd_prefill_url={url!r} must be http://HOST:PORT")
        if api_key is not None:
            check_api_key(api_key)
        self.url = url.rstrip("/")
        self._headers = {} if api_key is None else {"Authorization": f"Bearer {api_key}"}
        self._host, self._port = parsed.hostname, parsed.port or 80
        self._timeout_s, self._start_wait_s = timeout_s, start_wait_s
        self._fingerprint: ModelFingerprint | None = None
        self._arrived: queue.SimpleQueue[PrefilledRequest | TransferFailed] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._sockets: dict[str, socket.socket | None] = {}     # orders in flight (None: not connected yet)
        self._queued: set[str] = set()          # orders answered, not yet polled
        self._cancelled: set[str] = set()       # of those, the ones cancelled since (poll drops them)
        self._stats = TransferStats()
        self._workers = ThreadPoolExecutor(MAX_ORDERS_IN_FLIGHT, thread_name_prefix="deepinfer-pd-fetch")

    def connect(self, fingerprint: ModelFingerprint) -> None:
        """Compare fingerprints with the prefill server's (`KVTransfer.connect`). A server that refuses
        the connection or has no engine yet (both started at once) is retried for up to start_wait_s."""
        deadline = time.monotonic() + self._start_wait_s
        while True:
            try:
                status, body = self._info()
            except (OSError, http.client.HTTPException, ValueError) as err:
                if isinstance(err, ConnectionRefusedError) and time.monotonic() < deadline:
                    time.sleep(0.2)
                    continue
                raise ConnectionError(f"cannot reach the prefill server at {self.url}: {_said(err)}") from None
            if status == 503 and time.monotonic() < deadline:
                time.sleep(0.2)
                continue
            break
        if status == 401:
            sent = "refused this decode server's API key" if self._headers else "wants an API key; none was sent"
            raise ConnectionError(f"the prefill server at {self.url} {sent} (401 invalid_api_key): give the decode "
                                  "server --pd-prefill-api-key set to the prefill server's --api-key (by default "
                                  "its own --api-key is sent)")
        if status != 200 or not isinstance(body, dict) or "fingerprint_key" not in body:
            raise ConnectionError(f"{self.url} is not a prefill server (GET /v1/pd/info answered {status}; "
                                  "start it with `deepinfer serve --pd-role prefill`)")
        if body["fingerprint_key"] != fingerprint.key:
            raise ValueError(f"the prefill server at {self.url} serves {body.get('model')} (key "
                             f"{str(body['fingerprint_key'])[:12]}), this decode server {fingerprint.model} (key "
                             f"{fingerprint.key[:12]}): they cannot hand KV over (same model, dtypes, max_model_len "
                             "and cache layout needed)")
        self._fingerprint = fingerprint

    def _info(self) -> tuple[int, object]:
        """(status, JSON body) of GET /v1/pd/info."""
        conn = http.client.HTTPConnection(self._host, self._port, timeout=CONNECT_TIMEOUT_S)
        try:
            conn.request("GET", "/v1/pd/info", headers=self._headers)
            response = conn.getresponse()
            return response.status, json.loads(response.read() or b"null")
        finally:
            conn.close()

    def send(self, handoff: PrefilledRequest) -> None:
        raise RuntimeError("HttpPrefillClient is the decode side; a PROMPT engine sends through PrefillExports")

    def request_prefill(self, order: PrefillOrder) -> None:
        if self._fingerprint is None:
            raise RuntimeError("HttpPrefillClient.connect was not called")
        with self._lock:
            self._sockets[order.request_id] = None
        self._workers.submit(self._fetch, order, self._fingerprint)

    def cancel(self, request_id: str) -> None:
        with self._lock:
            sock = self._sockets.pop(request_id, None)
            if request_id in self._queued:
                self._cancelled.add(request_id)
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def poll(self, timeout_s: float) -> list[PrefilledRequest | TransferFailed]:
        items: list[PrefilledRequest | TransferFailed] = []
        try:
            items.append(self._arrived.get(timeout=timeout_s) if timeout_s > 0 else self._arrived.get_nowait())
            while True:
                items.append(self._arrived.get_nowait())
        except queue.Empty:
            pass
        with self._lock:
            wanted = [item for item in items if item.request_id not in self._cancelled]
            for item in items:
                self._queued.discard(item.request_id)
                self._cancelled.discard(item.request_id)
        return wanted

    def stats(self) -> TransferStats:
        with self._lock:
            return self._stats

    # ------------------------------------------------------------------ worker threads

    def _fetch(self, order: PrefillOrder, fingerprint: ModelFingerprint) -> None:
        started = time.perf_counter()
        conn = http.client.HTTPConnection(self._host, self._port, timeout=CONNECT_TIMEOUT_S)
        try:
            conn.connect()
            conn.sock.settimeout(self._timeout_s)
            with self._lock:
                if order.request_id not in self._sockets:      # cancelled before it connected
                    return
                self._sockets[order.request_id] = conn.sock
            conn.request("POST", "/v1/pd/prefill", json.dumps(order_json(order, fingerprint)).encode(),
                         {"Content-Type": "application/json", **self._headers})
            response = conn.getresponse()
            if response.status != 200:
                message = _error_message(response.read())
                item: PrefilledRequest | TransferFailed = TransferFailed(
                    order.request_id, f"the prefill server at {self.url} answered {response.status}: {message}")
            else:
                item = read_handoff(response.read)
                if item.request_id != order.request_id:
                    raise ValueError(f"the prefill server sent request {item.request_id!r} for {order.request_id!r}")
        except (OSError, http.client.HTTPException, ValueError) as err:
            item = TransferFailed(order.request_id, f"the transfer from the prefill server at {self.url} failed: "
                                                    f"{_said(err)}")
        finally:
            conn.close()
        with self._lock:
            if self._sockets.pop(order.request_id, "cancelled") == "cancelled":
                return                              # cancelled: nobody wants it
            if isinstance(item, PrefilledRequest):
                num_bytes = 0 if item.kv is None else item.kv.num_bytes
                self._stats = TransferStats(self._stats.num_transfers + 1, self._stats.num_bytes + num_bytes,
                                            self._stats.seconds + time.perf_counter() - started)
            self._queued.add(order.request_id)
            self._arrived.put(item)


def check_api_key(api_key: str) -> None:
    """Raises ValueError unless `api_key` can go in an `Authorization` header: a non-empty str of
    printable ASCII (the message does not repeat the key)."""
    if not isinstance(api_key, str) or not api_key or not (api_key.isascii() and api_key.isprintable()):
        raise ValueError("the prefill server's API key must be a non-empty str of printable ASCII characters (it "
                         "goes in an HTTP header)")


def _said(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}" if str(err) else type(err).__name__


def _error_message(body: bytes) -> str:
    """The message of an OpenAI-shaped error body, else the body's start."""
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body[:200].decode(errors="replace") or "(no body)"


__all__ = ["HttpPrefillClient", "check_api_key"]
