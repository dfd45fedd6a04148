"""
The HTTP side of serving, below the routes: a trace and a log line for every request, and the guards that keep
slow clients from holding connections (scripts/chat_web.py installs them; nanorl/serving.py counts what they see).
"""

import asyncio
import json
import logging
import time

from nanorl.openai_api import error_body
from nanorl.serving import Trace

log = logging.getLogger("nanorl.serve")


class RequestLog:
    """ASGI middleware: gives each request a Trace (request.state.trace, its id in the x-request-id header), and
    when its response has ended logs one line (id, method, path, status, tokens in/out, time to first token, time)
    and counts it in the stats by route and status."""

    def __init__(self, app, stats):
        self.app, self.stats = app, stats

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        trace = Trace(scope["method"], scope["path"])
        scope.setdefault("state", {})["trace"] = trace

        async def send_traced(msg):
            if msg["type"] == "http.response.start":
                trace.status = msg["status"]
                msg = {**msg, "headers": [*msg.get("headers", []), (b"x-request-id", trace.id.encode())]}
            await send(msg)

        try:
            await self.app(scope, receive, send_traced)
        finally:
            took = time.perf_counter() - trace.start
            route = getattr(scope.get("route"), "path", "other")  # the route's template: no label per unknown path
            self.stats.answered[(route, trace.status)] += 1
            self.stats.duration.observe(took)
            log.info(trace.line(took))


# --- slow clients -----------------------------------------------------------------------------------------------------
# uvicorn closes a kept-alive connection that stays silent after a response (its timeout_keep_alive), but it has no
# deadline for a request's headers or body: a client that connects and says nothing, or trickles its bytes, holds a
# connection (and, for a body, a task) forever, and no uvicorn setting bounds that. So: HeaderDeadline times each
# connection from when it opens (or its last response ends) until its next request reaches the app, and BodyGuard
# bounds the time and size of each body and tells the connection's HeaderDeadline when a request begins and ends.


class HeaderDeadline(asyncio.Protocol):
    """One connection: uvicorn's h11 protocol inside (reached only through asyncio's Protocol interface), and a timer
    that answers 408 and closes the connection if the next request's headers are not all in within `timeout` s.
    `open` maps (client, server) addresses, as an ASGI scope names them, to the connection's deadline."""

    def __init__(self, timeout, open, **uvicorn_args):
        from uvicorn.protocols.http.h11_impl import H11Protocol  # what uvicorn's http="h11" would build

        self.inner, self.timeout, self.open = H11Protocol(**uvicorn_args), timeout, open
        self.transport, self.timer, self.key = None, None, None
        body = error_body(f"the request headers did not arrive within {timeout:g}s", code="request_timeout")
        self.reply = json.dumps(body).encode()

    def connection_made(self, transport):
        self.transport = transport
        peer, own = transport.get_extra_info("peername"), transport.get_extra_info("sockname")
        if isinstance(peer, tuple) and isinstance(own, tuple):
            self.key = (peer[0], peer[1], own[0], own[1])
            self.open[self.key] = self
        self.arm()
        self.inner.connection_made(transport)

    def data_received(self, data):
        self.inner.data_received(data)

    def eof_received(self):
        return self.inner.eof_received()

    def pause_writing(self):
        self.inner.pause_writing()

    def resume_writing(self):
        self.inner.resume_writing()

    def connection_lost(self, exc):
        self.disarm()
        self.open.pop(self.key, None)
        self.inner.connection_lost(exc)

    def arm(self):
        """Between requests: the next one's headers must arrive in time."""
        self.disarm()
        if not self.transport.is_closing():
            self.timer = asyncio.get_running_loop().call_later(self.timeout, self.too_slow)

    def disarm(self):
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def too_slow(self):
        self.timer = None
        if not self.transport.is_closing():
            head = b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
            self.transport.write(head + b"content-length: %d\r\n\r\n" % len(self.reply) + self.reply)
            self.transport.close()


class BodyGuard:
    """ASGI middleware: read each request's whole body within `timeout` seconds and at most max_bytes, else answer
    408 / 413 and close, so a client that trickles its body cannot hold a connection and a task forever. The app
    then reads the buffered body (and later receive() calls, e.g. a disconnect, come from the connection). While the
    app has the request, the connection's header deadline (if it has one: see HeaderDeadline) is off."""

    def __init__(self, app, timeout, max_bytes, open):
        self.app, self.timeout, self.max_bytes, self.open = app, timeout, max_bytes, open

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        client, server = scope.get("client") or ("", 0), scope.get("server") or ("", 0)
        conn = self.open.get((*client, *server))
        if conn is not None:
            conn.disarm()
        try:
            await self._call(scope, receive, send)
        finally:
            if conn is not None:
                conn.arm()

    def _refuse(self, status, message, code):
        from fastapi.responses import JSONResponse  # fastapi only where a server runs

        return JSONResponse(error_body(message, code=code), status, headers={"connection": "close"})

    async def _call(self, scope, receive, send):
        loop = asyncio.get_running_loop()
        deadline, chunks, size = loop.time() + self.timeout, [], 0
        while True:
            try:
                msg = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                late = f"the request body did not arrive within {self.timeout:g}s"
                return await self._refuse(408, late, "request_timeout")(scope, receive, send)
            if msg["type"] == "http.disconnect":
                return
            chunks.append(msg.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                reply = self._refuse(413, f"the request body is over {self.max_bytes} bytes", "request_too_large")
                return await reply(scope, receive, send)
            if not msg.get("more_body", False):
                break
        body = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay():
            return body.pop() if body else await receive()

        await self.app(scope, replay, send)
