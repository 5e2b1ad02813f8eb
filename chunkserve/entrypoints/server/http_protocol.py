"""uvicorn's HTTP/1.1 protocol (h11) with a deadline on each request's head.

uvicorn bounds nothing between a connection opening and its request's headers completing:
a client that sends half a request line and stops (a slow-loris), or opens a connection and
sends nothing, holds its socket forever, and a few thousand of them exhaust the server's file
descriptors. Its keep-alive timeout bounds only the silence between requests: the first byte
of the next request cancels it. So the deadline here starts when the connection opens, or
when the first byte of a keep-alive connection's next request arrives, and ends when h11 has
parsed the headers; the request's body is then BodySizeLimitMiddleware's to time, and a
response (however long it streams) is never timed.

The same deadline closes a connection whose response is complete while the client is still
sending the request's body (a 401 answered before the upload, then a stalled upload), which
uvicorn would otherwise also keep.
"""

from __future__ import annotations

import asyncio
import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from chunkserve.entrypoints.server.protocol import error_body


def header_timeout_protocol(timeout_s: float) -> type[H11Protocol]:
    """An H11Protocol subclass that closes a connection whose request head has not arrived
    `timeout_s` after it started (answering 408 first when part of it came); for
    `uvicorn.Config(app, http=header_timeout_protocol(t))`."""
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}")
    body = json.dumps(error_body(f"the request's headers did not arrive within {timeout_s:g} s",
                                 "timeout_error", 408)).encode()
    # Written raw: h11 cannot send a response while it waits for the request it would answer.
    timeout_response = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                        b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
    return type("HeaderTimeoutH11Protocol", (HeaderTimeoutH11Protocol,),
                {"timeout_s": timeout_s, "timeout_response": timeout_response})


class HeaderTimeoutH11Protocol(H11Protocol):
    """The protocol; header_timeout_protocol sets its deadline and its 408 response."""

    timeout_s: float
    timeout_response: bytes
    head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._update_head_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._update_head_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._update_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def _update_head_timer(self) -> None:
        """Arm the timer when a deadline starts, cancel it when the awaited part arrived.

        An armed timer is never re-armed: bytes that trickle in do not extend it.
        """
        if self.transport.is_closing():
            return self._cancel_head_timer()
        if self.conn.their_state is h11.IDLE:
            # Between requests with nothing received, the keep-alive timer is uvicorn's;
            # a fresh connection (or one whose keep-alive timer data cancelled) has none.
            waiting = bool(self.conn.trailing_data[0]) or self.timeout_keep_alive_task is None
        else:  # the response is done but the request's body is still on its way
            waiting = self.conn.our_state is h11.DONE and self.conn.their_state is h11.SEND_BODY
        if not waiting:
            self._cancel_head_timer()
        elif self.head_timer is None:
            self.head_timer = self.loop.call_later(self.timeout_s, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def _head_timed_out(self) -> None:
        self.head_timer = None
        if self.transport.is_closing():
            return
        # No 408 to a client that sent nothing: that is an idle connection, not a request.
        if self.conn.their_state is h11.IDLE and self.conn.trailing_data[0]:
            self.transport.write(self.timeout_response)
        try:
            self.conn.send(h11.ConnectionClosed())
        except h11.LocalProtocolError:  # mid-exchange: h11 refuses, but the socket closes all the same
            pass
        self.transport.close()
