"""uvicorn's h11 protocol with OpenAI-style bodies for malformed HTTP, and 431 for huge headers.

uvicorn answers any h11 protocol error with a plain-text 400. h11 signals an oversized
header block by a receive buffer longer than its limit, so we check that to answer 431.
"""

from __future__ import annotations

import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


class OpenAIH11Protocol(H11Protocol):
    """H11Protocol whose protocol-error replies are JSON error bodies (400 or 431)."""

    def send_400_response(self, msg: str) -> None:
        buffered = len(getattr(self.conn, "_receive_buffer", b""))
        limit = getattr(self.conn, "_max_incomplete_event_size", None)
        if limit is not None and buffered > limit:
            status, reason = 431, b"Request Header Fields Too Large"
            message = f"Request headers exceed {limit} bytes."
        else:
            status, reason = 400, b"Bad Request"
            message = "Invalid HTTP request received."
        body = json.dumps(
            {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": None}}
        ).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"connection", b"close"),
            (b"content-length", str(len(body)).encode()),
        ]
        self.transport.write(self.conn.send(h11.Response(status_code=status, headers=headers, reason=reason)))
        self.transport.write(self.conn.send(h11.Data(data=body)))
        self.transport.write(self.conn.send(h11.EndOfMessage()))
        self.transport.close()
