"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with an HTTP status."""

from __future__ import annotations

import re
from typing import Any

from ..sampling.sampling_params import InvalidSamplingParams


class APIError(Exception):
    """An error answered to the client.

    Args:
        status: HTTP status (400 bad request, 401 no or wrong key, 404 unknown model, 413 body too large,
            503 queue full, ...).
        message: what went wrong, naming the field at fault when there is one.
        param: the request field at fault (dotted / indexed path), or None.
        code: a short machine-readable code, or None.
    """

    _TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
              413: "invalid_request_error", 503: "server_error", 500: "server_error"}

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, Any]:
        """The JSON body: {"error": {"message", "type", "param", "code"}}."""
        kind = self._TYPES.get(self.status, "server_error")
        # A message quoting user text could hold a lone surrogate, which no JSON response can encode.
        message = self.message.encode("utf-8", "backslashreplace").decode("utf-8")
        return {"error": {"message": message, "type": kind, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None) -> APIError:
    return APIError(400, message, param=param)


_FIELD = re.compile(r"^([a-z_]+)")


def from_sampling_error(error: InvalidSamplingParams, structured_field: str) -> APIError:
    """A 400 for a SamplingParams / StructuredOutput error; `param` is the field its message starts with
    (`structured...` messages are charged to `structured_field`, the request field that set it)."""
    message = str(error)
    if message.startswith("structured") or message.startswith("ignore_eos=True cannot be combined"):
        return bad_request(f"{structured_field}: {message}", structured_field)
    match = _FIELD.match(message)
    return bad_request(message, match.group(1) if match else None)
