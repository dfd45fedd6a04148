"""
Rewards scored by an HTTP server (--rm-type remote): each sample is POSTed as JSON, `concurrency` at a time,
and the server answers {"reward": number} or {"reward": {component: number, ..., "total": number}}.

    results = remote_rewards(url, payloads)   # [(value, None) or (None, why it failed)], in payload order

Every attempt ends by its deadline whatever the server does (a server trickling one byte at a time included);
refused connections, 5xx/429 and timeouts are retried with backoff, malformed answers are not. Never raises.
"""

import http.client
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from nanorl.rewards import check_reward


class _Retryable(Exception):
    pass


class _DeadlineHandler(urllib.request.HTTPHandler, urllib.request.HTTPSHandler):
    """Makes urllib's connections known, so a timer can cut them at the attempt's deadline: a socket
    timeout alone bounds each read, and a server trickling a byte at a time would never hit it."""

    def __init__(self, deadline):
        urllib.request.HTTPHandler.__init__(self)
        urllib.request.HTTPSHandler.__init__(self)
        self.deadline, self.socks, self.expired = deadline, [], False

    def _connection(self, cls, host, **kwargs):
        kwargs["timeout"] = max(0.001, self.deadline - time.monotonic())  # connecting counts too
        conn = cls(host, **kwargs)
        connect = conn.connect

        def connect_and_track():  # keep the socket: urllib drops conn.sock once the headers are in
            connect()
            self.socks.append(conn.sock)
            if self.expired:
                self.expire()

        conn.connect = connect_and_track
        return conn

    def http_open(self, req):
        return self.do_open(lambda host, **kw: self._connection(http.client.HTTPConnection, host, **kw), req)

    def https_open(self, req):
        return self.do_open(
            lambda host, **kw: self._connection(http.client.HTTPSConnection, host, **kw), req, context=self._context
        )

    def expire(self):
        self.expired = True
        for sock in self.socks:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes the blocked read with EOF or an error
            except OSError:
                pass


def _post_once(url, body, timeout):
    """One POST that ends within `timeout` seconds whatever the server does; the parsed reward, or raise
    _Retryable (worth another try) / ValueError (not)."""
    req = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": "application/json"})
    handler = _DeadlineHandler(time.monotonic() + timeout)
    timer = threading.Timer(timeout, handler.expire)
    timer.daemon = True
    timer.start()
    try:
        with urllib.request.build_opener(handler).open(req, timeout=timeout) as resp:
            raw = resp.read()
        if handler.expired:  # the cut may look like a short, complete answer
            raise TimeoutError
    except urllib.error.HTTPError as e:
        if e.code >= 500 or e.code == 429:
            raise _Retryable(f"HTTP {e.code}") from None
        raise ValueError(f"HTTP {e.code}") from None
    except Exception as e:  # refused, reset, cut at the deadline, RemoteDisconnected, IncompleteRead, ...
        if handler.expired or isinstance(e, TimeoutError):
            raise _Retryable(f"timed out after {timeout:g}s") from None
        reason = getattr(e, "reason", e)
        raise _Retryable(f"{type(reason).__name__}: {reason}") from None
    finally:
        timer.cancel()
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise ValueError(f"malformed JSON response: {raw[:80]!r}") from None
    if not isinstance(data, dict) or "reward" not in data:
        raise ValueError(f"response has no 'reward' key: {raw[:80]!r}")
    reward = data["reward"]
    value, err = check_reward(reward)
    if err is not None:
        raise ValueError(err)
    return value


def _post_with_retries(url, payload, timeout, retries, backoff):
    try:
        body = json.dumps(payload).encode()
    except (TypeError, ValueError) as e:
        return None, f"payload is not JSON-serializable: {e}"
    err = None
    for attempt in range(retries + 1):
        if attempt:
            time.sleep(backoff * 2 ** (attempt - 1))  # 0.5, 1, 2, ... so a restarting server gets room
        try:
            return _post_once(url, body, timeout), None
        except _Retryable as e:
            err = str(e)
        except Exception as e:  # a bad answer will not get better by asking again
            return None, str(e)
    return None, f"gave up after {retries + 1} attempts: {err}"


def remote_rewards(url, payloads, concurrency=8, timeout=10.0, retries=3, backoff=0.5):
    """POST each payload (a dict) as JSON to url, `concurrency` at a time; a list in payload order of
    (value, None) or (None, reason). Connection errors, 5xx/429 and timeouts are retried with exponential
    backoff; malformed answers are not. Never raises."""
    payloads = list(payloads)
    if not payloads:
        return []
    pool = ThreadPoolExecutor(max_workers=max(1, min(concurrency, len(payloads))))
    try:
        futures = [pool.submit(_post_with_retries, url, p, timeout, retries, backoff) for p in payloads]
        results = []
        for f in futures:
            try:
                results.append(f.result())
            except Exception as e:  # belt and braces: _post_with_retries already catches everything
                results.append((None, f"{type(e).__name__}: {e}"))
        return results
    finally:
        # never wait here for workers still blocked in a call: when --rollout-timeout interrupts this function the
        # rollout must end now, not when the last socket gives up
        pool.shutdown(wait=False, cancel_futures=True)
