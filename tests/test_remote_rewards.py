"""--rm-timeout is a deadline per attempt: a reward server that trickles its answer can not stall a rollout."""

import socket
import threading
import time

import pytest

from nanorl.remote_rewards import remote_rewards
from nanorl.rewards import set_rewards
from nanorl.rollout import Sample


@pytest.fixture
def trickle_server():
    """A raw HTTP server on 127.0.0.1 that sends its answer one byte every 0.5 s; /body trickles the body of a
    long response after prompt headers, anything else trickles the status line itself."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    stop = threading.Event()

    def answer(conn):
        with conn:
            conn.settimeout(5)
            try:
                request = conn.recv(65536)
                if request.split(b" ")[1] == b"/body":
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n")
                reply = b'HTTP/1.1 200 OK\r\n\r\n{"reward": 1.0}' + b" " * 1000
                for i in range(len(reply)):
                    if stop.wait(0.5):
                        return
                    conn.sendall(reply[i : i + 1])
            except OSError:
                pass  # the client hung up: that is the point

    def accept():
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=answer, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    stop.set()
    server.close()


@pytest.mark.parametrize("path", ["/head", "/body"])
def test_timeout_is_a_deadline_per_attempt(trickle_server, path):
    t = time.monotonic()
    results = remote_rewards(trickle_server + path, [{"id": 0}, {"id": 1}], timeout=1.0, retries=0)
    elapsed = time.monotonic() - t
    assert results == [(None, "gave up after 1 attempts: timed out after 1s")] * 2
    assert 0.9 < elapsed < 1.8, elapsed  # per socket read it was: never, one byte arrives every 0.5 s
    t = time.monotonic()
    results = remote_rewards(trickle_server + path, [{"id": 0}], timeout=0.5, retries=2, backoff=0.05)
    elapsed = time.monotonic() - t
    assert results == [(None, "gave up after 3 attempts: timed out after 0.5s")]
    assert 1.65 - 0.1 < elapsed < 1.65 + 0.8, elapsed  # 3 attempts of 0.5 s + backoff 0.05 + 0.1


@pytest.mark.parametrize("on_failure,want", [("drop", [0.0, 0.0]), ("zero", [0.0, 0.0])])
def test_timed_out_reward_is_a_failure_per_rm_failure(trickle_server, on_failure, want):
    samples = [Sample(tokens=[1, 2, 3], response_length=2, loss_mask=[1, 1], index=i) for i in range(2)]
    results = remote_rewards(trickle_server + "/head", [{"id": i} for i in range(2)], timeout=0.5, retries=0)
    failed = set_rewards([samples], samples, results, on_failure)
    assert failed == samples and all("timed out after 0.5s" in s.metadata["reward_error"] for s in samples)
    assert [s.reward for s in samples] == want
    # drop: never trained on; zero: an ordinary sample with reward 0
    assert [s.loss_mask for s in samples] == ([[0, 0]] * 2 if on_failure == "drop" else [[1, 1]] * 2)
