"""An S3 endpoint that refuses connections fails in two attempts per request, not six; other
failures keep botocore's retries."""

from __future__ import annotations

import asyncio
import functools
import socket
import subprocess
import sys
import threading

import pytest

from ckptfmt import StorageError
from ckptfmt.storage.factory import open_storage
from ckptfmt.storage.object_store import REFUSED_ATTEMPTS


@pytest.fixture
def refused_endpoint(monkeypatch) -> str:
    """An endpoint on which nothing listens: a port that was free a moment ago."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    for name, value in {"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "y", "AWS_DEFAULT_REGION": "us-east-1",
                        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"}.items():
        monkeypatch.setenv(name, value)
    return f"http://127.0.0.1:{port}"


def attempts_per_request(storage) -> list[str]:
    """Record each attempt botocore sends (its operation's name), retries included."""
    seen: list[str] = []
    storage.fs.s3.meta.events.register("before-send.s3", lambda request, **_: seen.append(request.method))
    return seen


def test_a_refused_connection_is_tried_twice(refused_endpoint):
    storage = open_storage("s3://bucket/run", {"skip_instance_cache": True})
    seen = attempts_per_request(storage)
    with pytest.raises(StorageError, match="Could not connect to the endpoint URL") as info:
        storage.read("ckptfmt.json", max_size=1024)
    assert seen == ["GET"] * REFUSED_ATTEMPTS
    # The cause is kept: botocore's error, and under it the refused connection itself.
    causes = []
    cause = info.value.__cause__
    while cause is not None:
        causes.append(type(cause).__name__)
        cause = cause.__cause__ or cause.__context__
    assert "EndpointConnectionError" in causes, causes


@pytest.mark.slow
def test_debug_shows_the_backends_error_under_the_one_line(refused_endpoint, tmp_path):
    result = subprocess.run([sys.executable, "-m", "ckptfmt.cli", "--debug", "ls", "s3://bucket/run"],
                            capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 2
    stderr = result.stderr
    # The whole chain, from the socket up: the refusal, botocore's error, then ckptfmt's.
    assert stderr.index("ConnectionRefusedError") < stderr.index("EndpointConnectionError: Could not connect") \
        < stderr.index("StorageError: s3://bucket/run/ckptfmt.json")
    assert "The above exception was the direct cause of the following exception" in stderr


@pytest.mark.slow
def test_the_cli_says_so_in_one_line(refused_endpoint, tmp_path):
    result = subprocess.run([sys.executable, "-m", "ckptfmt.cli", "ls", "s3://bucket/run"], capture_output=True,
                            text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [f'ckptfmt: error: s3://bucket/run/ckptfmt.json: Could not connect to the '
                                          f'endpoint URL: "{refused_endpoint}/bucket/run/ckptfmt.json"']


@pytest.mark.slow
def test_other_connection_failures_keep_every_retry(monkeypatch):
    """An endpoint that accepts the connection and closes it unanswered gets every attempt (of botocore's:
    ckptfmt's own read loop tries once here, or the test would wait through its backoff for nothing).
    The clients' backoffs (asyncio sleeps of botocore's and s3fs's retries) only yield here: 8 s else."""
    monkeypatch.setattr(asyncio, "sleep", functools.partial(_yield_only, asyncio.sleep))
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(64)
        port = server.getsockname()[1]
        for name, value in {"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "y",
                            "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"}.items():
            monkeypatch.setenv(name, value)
        def hang_up() -> None:
            while True:
                try:
                    connection, _ = server.accept()
                except OSError:
                    return
                connection.close()
        threading.Thread(target=hang_up, daemon=True).start()
        storage = open_storage("s3://bucket/run", {"skip_instance_cache": True, "read_tries": 1,
                                                   "config_kwargs": {"retries": {"mode": "standard",
                                                                                 "total_max_attempts": 3}}})
        numbers: list[int] = []
        storage.fs.s3.meta.events.register("needs-retry.s3", lambda attempts, **_: numbers.append(attempts))
        with pytest.raises(StorageError):
            storage.read("ckptfmt.json", max_size=1024)
    assert max(numbers) == 3 > REFUSED_ATTEMPTS  # every attempt asked for (s3fs repeats them)


async def _yield_only(sleep, delay: float, result: object = None) -> object:
    """``asyncio.sleep`` that lets the other tasks run once, whatever ``delay`` it is given."""
    return await sleep(0, result)
