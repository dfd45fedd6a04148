"""A reward server for tests, on 127.0.0.1 in a thread: the path picks how it behaves (a good answer, a
500, a hang, malformed JSON, ...), so the remote-reward client and the RL loop meet every failure for real."""

import json
import threading
import time
from collections import Counter
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar


class RewardHandler(BaseHTTPRequestHandler):
    hits: ClassVar[Counter] = Counter()  # (path, payload id) -> requests seen
    payloads: ClassVar[list] = []  # every JSON body received, in arrival order
    lock = threading.Lock()

    def do_POST(self):
        payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.lock:
            self.payloads.append(payload)
            self.hits[self.path, payload.get("id")] += 1
            n = self.hits[self.path, payload.get("id")]
        if self.path == "/ok":
            self._send(200, {"reward": payload["x"] * 0.5})
        elif self.path == "/dict":
            self._send(200, {"reward": {"acc": 1, "fmt": 0.5, "total": 1.5}})
        elif self.path == "/flaky":  # two 500s per payload, then an answer
            self._send(500, {"error": "busy"}) if n <= 2 else self._send(200, {"reward": 1.0})
        elif self.path == "/slow":
            time.sleep(float(payload.get("sleep", 1.0)))
            self._send(200, {"reward": 1.0})
        elif self.path == "/hang":  # a grader that never answers in time
            time.sleep(30.0)
            self._send(200, {"reward": 1.0})
        elif self.path == "/badjson":
            self._send_raw(200, b"{not json")
        elif self.path == "/string":
            self._send(200, {"reward": "high"})
        elif self.path == "/nan":
            self._send_raw(200, b'{"reward": NaN}')
        elif self.path == "/nokey":
            self._send(200, {"score": 1.0})
        elif self.path == "/mixed":  # what an RL run meets: the response's length picks success or a failure
            self._mixed(payload["response"])
        else:
            self._send(404, {"error": "no such endpoint"})

    def _mixed(self, response):
        kind = len(response) % 5
        if kind == 0:
            self._send(500, {"error": "grader crashed"})
        elif kind == 1:
            time.sleep(3.0)  # longer than the client's timeout
            self._send(200, {"reward": 1.0})
        elif kind == 2:
            self._send_raw(200, b"{'reward': 1")
        else:  # the fraction of vowels, so rewards differ within a group
            self._send(200, {"reward": sum(c in "aeiou" for c in response) / max(len(response), 1)})

    def _send(self, code, obj):
        self._send_raw(code, json.dumps(obj).encode())

    def _send_raw(self, code, body):
        try:
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client timed out and hung up, as the hang endpoints intend

    def log_message(self, *args):
        pass  # keep pytest output clean


@contextmanager
def reward_server():
    """Serve RewardHandler on a free port of 127.0.0.1; yields the base URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), RewardHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
