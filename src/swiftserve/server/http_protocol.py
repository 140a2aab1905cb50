"""uvicorn's h11 protocol with OpenAI-style error bodies, 431 for huge headers, and timeouts.

uvicorn answers any h11 protocol error with a plain-text 400. h11 signals an oversized
header block by a receive buffer longer than its limit, so we check that to answer 431.

uvicorn times out only idle keep-alive connections between requests: a client that opens a
socket and sends nothing, or sends headers or a body a byte at a time, holds it forever. Here
every connection has a deadline for its request headers (from the connection, or from the
first byte after a response) and then one for the body; past it, a 408 and the socket closes.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


def _error_bytes(message: str) -> tuple[list[tuple[bytes, bytes]], bytes]:
    """Headers and body of a connection-closing OpenAI-style error."""
    body = json.dumps(
        {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": None}}
    ).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"connection", b"close"),
        (b"content-length", str(len(body)).encode()),
    ]
    return headers, body


class OpenAIH11Protocol(H11Protocol):
    """H11Protocol whose protocol-error replies are JSON bodies, with header and body deadlines."""

    header_timeout: float | None = 10.0
    body_timeout: float | None = 30.0

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._phase: str | None = None  # "headers", "body" or None (nothing awaited)

    @classmethod
    def with_timeouts(
        cls, header_timeout: float | None, body_timeout: float | None
    ) -> type[OpenAIH11Protocol]:
        """A subclass with these deadlines (None: no deadline), for uvicorn's ``http=``."""
        return type(
            "OpenAIH11ProtocolT", (cls,), {"header_timeout": header_timeout, "body_timeout": body_timeout}
        )

    # ---- deadlines ---------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm("headers", self.header_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        super().handle_events()
        self._follow_state()

    def on_response_complete(self) -> None:
        self._disarm()  # between requests uvicorn's keep-alive timeout applies
        super().on_response_complete()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._phase is None and self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self._arm("headers", self.header_timeout)  # first bytes of the next request

    def _follow_state(self) -> None:
        state = self.conn.their_state
        if state is h11.SEND_BODY and self._phase == "headers":
            self._arm("body", self.body_timeout)
        elif state in (h11.DONE, h11.MUST_CLOSE, h11.CLOSED, h11.ERROR):
            self._disarm()

    def _arm(self, phase: str, timeout: float | None) -> None:
        self._disarm()
        if timeout is not None:
            self._phase = phase
            self._deadline = self.loop.call_later(timeout, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline, self._phase = None, None

    def _expired(self) -> None:
        phase = self._phase
        self._deadline, self._phase = None, None
        if self.transport.is_closing():
            return
        started = self.cycle is not None and self.cycle.response_started and not self.cycle.response_complete
        if not started and (phase == "headers" or self.conn.our_state is h11.SEND_RESPONSE):
            headers, body = _error_bytes(f"The request {phase} took too long to arrive.")
            head = b"HTTP/1.1 408 Request Timeout\r\n" + b"".join(k + b": " + v + b"\r\n" for k, v in headers)
            self.transport.write(head + b"\r\n" + body)
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.disconnected = True
            self.cycle.message_event.set()
        self.transport.close()

    # ---- protocol errors ---------------------------------------------------------------------
    def send_400_response(self, msg: str) -> None:
        self._disarm()
        buffered = len(getattr(self.conn, "_receive_buffer", b""))
        limit = getattr(self.conn, "_max_incomplete_event_size", None)
        if limit is not None and buffered > limit:
            status, reason = 431, b"Request Header Fields Too Large"
            message = f"Request headers exceed {limit} bytes."
        else:
            status, reason = 400, b"Bad Request"
            message = "Invalid HTTP request received."
        headers, body = _error_bytes(message)
        self.transport.write(self.conn.send(h11.Response(status_code=status, headers=headers, reason=reason)))
        self.transport.write(self.conn.send(h11.Data(data=body)))
        self.transport.write(self.conn.send(h11.EndOfMessage()))
        self.transport.close()
