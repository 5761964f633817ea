"""Request-body limits: the cap while a body streams, the read timeout, and what a client is told.

The middleware alone, on ASGI messages (no server), then a real ``aitune serve``: stalled uploads
hold nothing another client needs, a chunked body past the cap is cut with the server barely
growing, and over-long rows are refused before they run.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import socket
import threading
from pathlib import Path

import pytest

from aitune_serve_kserve.limits import BodyLimits


class _App:
    """An ASGI app that reads the whole body and answers it back."""

    def __init__(self) -> None:
        self.calls = 0

    async def __call__(self, scope, receive, send) -> None:
        self.calls += 1
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": body})


def _run(limits: BodyLimits, chunks, *, headers=(), method="POST", stall_after: int | None = None):
    """Run ``limits`` on a request sending ``chunks``; the messages it sent, and how many chunks it read."""
    read = []

    async def receive():
        if stall_after is not None and len(read) == stall_after:
            await asyncio.sleep(3600)
        index = len(read)
        read.append(index)
        return {"type": "http.request", "body": chunks[index], "more_body": index < len(chunks) - 1}

    sent = []

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": method, "headers": list(headers)}
    asyncio.run(limits(scope, receive, send))
    return sent, len(read)


def _status_and_error(sent) -> tuple[int, str]:
    body = json.loads(b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body"))
    return sent[0]["status"], body["error"]


def test_a_body_within_the_cap_reaches_the_app_whole():
    app = _App()
    sent, _ = _run(BodyLimits(app, max_body_bytes=10), [b"abc", b"def", b"g"])
    assert sent[0]["status"] == 200 and sent[1]["body"] == b"abcdefg" and app.calls == 1


def test_a_streamed_body_is_cut_as_soon_as_it_passes_the_cap():
    app = _App()
    chunks = [b"x" * 4] * 100  # a chunked body: no Content-Length to refuse it by
    sent, read = _run(BodyLimits(app, max_body_bytes=10), chunks)
    status, error = _status_and_error(sent)
    assert status == 413 and "at most 10 bytes" in error and "--max-body-mb" in error
    assert read == 3, "reading stops at the chunk that passes the cap"
    assert app.calls == 0
    assert (b"connection", b"close") in sent[0]["headers"]


def test_a_declared_length_past_the_cap_is_refused_before_reading():
    app = _App()
    sent, read = _run(BodyLimits(app, max_body_bytes=10), [b"x"], headers=[(b"content-length", b"200000000")])
    assert _status_and_error(sent)[0] == 413 and read == 0 and app.calls == 0


def test_a_stalled_body_is_dropped_after_the_read_timeout():
    app = _App()
    sent, _ = _run(BodyLimits(app, read_timeout_s=0.05), [b"a", b"b"], stall_after=1)
    status, error = _status_and_error(sent)
    assert status == 408 and "stalled" in error and "after 1 bytes" in error
    assert app.calls == 0


def test_requests_without_a_body_pass_through():
    app = _App()
    sent, _ = _run(BodyLimits(app, max_body_bytes=0), [b""], method="GET")
    assert sent[0]["status"] == 200 and app.calls == 1


# -- on a real server ----------------------------------------------------------------------------------------


def _infer_body(rows: int, row_elements: int = 8 * 16) -> bytes:
    data = [0.5] * (rows * row_elements)
    shape = [rows, 8, 16] if row_elements == 8 * 16 else [rows, row_elements // 16, 16]
    return json.dumps({"inputs": [{"name": "x", "shape": shape, "datatype": "FP32", "data": data}]}).encode()


def _post(port: int, body: bytes, timeout: float = 30) -> tuple[int, dict]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        connection.request("POST", "/v2/models/twoheads/infer", body, {"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.mark.slow
def test_stalled_uploads_hold_nothing_and_a_chunked_flood_is_cut(artifact, tmp_path):
    from kserve_harness import running

    with running(artifact, tmp_path / "serve.log", "--max-body-mb", "8", "--read-timeout-s", "3") as server:
        server.wait_ready("twoheads")
        stalled = []
        for _ in range(70):  # headers and one body byte, then nothing
            sock = socket.create_connection(("127.0.0.1", server.port))
            sock.sendall(
                b"POST /v2/models/twoheads/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 1000\r\n\r\n{"
            )
            stalled.append(sock)
        try:
            status, answer = _post(server.port, _infer_body(2), timeout=10)
            assert status == 200, answer  # answered while 70 uploads stall (the harness allows 10 s; it takes ms)
            for sock in stalled:  # each stalled upload is dropped with a 408 after the read timeout
                sock.settimeout(30)
                reply = sock.recv(4096)
                assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
        finally:
            for sock in stalled:
                sock.close()

        before = _rss_mb(server.process.pid)
        sock = socket.create_connection(("127.0.0.1", server.port))
        try:
            sock.sendall(
                b"POST /v2/models/twoheads/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n"
            )
            chunk = b"%x\r\n%s\r\n" % (1 << 20, b" " * (1 << 20))
            replies: list[bytes] = []
            reader = threading.Thread(target=lambda: replies.append(sock.recv(4096)), daemon=True)
            reader.start()
            sent = 0
            with contextlib.suppress(OSError):  # the server closes the connection once it answered
                while sent < 200 and not replies:
                    sock.sendall(chunk)
                    sent += 1
            reader.join(timeout=30)
            reply = replies[0] if replies else b""
        finally:
            sock.close()
        assert reply.startswith(b"HTTP/1.1 413"), reply[:300]
        assert sent < 50, f"{sent} MiB were taken before the cap of 8 MiB answered"
        assert _rss_mb(server.process.pid) - before < 100

        status, answer = _post(server.port, _infer_body(1, row_elements=100 * 16 * 8))
        assert status == 400 and "elements per row" in answer["error"], answer
        assert server.stop() == 0, server.output()
