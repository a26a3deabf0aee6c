"""Shared fixtures: a moto S3 server, per-test buckets, and a repository URL on every backend.

``repo_url`` is parametrized over local disk, ``memory://`` and S3 (moto), so one
test body runs against all three storage backends.
"""

from __future__ import annotations

import logging
import subprocess
import uuid
from pathlib import Path

import fsspec
import pytest
import torch

from tests.support import markers
from tests.support.helpers import make_root

AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def _clear_s3fs_cache() -> None:
    """Forget cached S3FileSystem instances so the next one sees the current settings."""
    try:
        import s3fs
    except ImportError:  # pragma: no cover - s3fs is a test dependency
        return
    s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture(scope="session")
def s3_server():
    """A moto S3 server on a free local port, with fake credentials and AWS_ENDPOINT_URL set.

    Yields the endpoint URL. Started once per session, on first use.
    """
    from moto.server import ThreadedMotoServer

    markers.require("s3")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one log line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    assert port != 0
    endpoint = f"http://{host}:{port}"
    with pytest.MonkeyPatch.context() as mp:
        for name, value in AWS_ENV.items():
            mp.setenv(name, value)
        mp.setenv("AWS_ENDPOINT_URL", endpoint)
        for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN"):
            mp.delenv(name, raising=False)
        mp.delenv("AWS_CONFIG_FILE", raising=False)
        mp.delenv("AWS_SHARED_CREDENTIALS_FILE", raising=False)
        _clear_s3fs_cache()
        try:
            yield endpoint
        finally:
            _clear_s3fs_cache()
            server.stop()


@pytest.fixture
def s3_client(s3_server):
    import boto3

    return boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1")


@pytest.fixture
def s3_bucket(s3_server, s3_client):
    """A fresh, uniquely named bucket for this test; yields its s3:// URL."""
    markers.require("s3")
    name = f"ckpt-{uuid.uuid4().hex[:20]}"
    s3_client.create_bucket(Bucket=name)
    # The S3FileSystem instance is shared across tests (creating one costs ~0.5 s); the
    # session fixture cleared the cache once so that it was built with the settings above.
    yield f"s3://{name}"
    # Leave moto's memory bounded across a long session.
    paginator = s3_client.get_paginator("list_objects_v2")
    for page in paginator.paginate(Bucket=name):
        objects = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if objects:
            s3_client.delete_objects(Bucket=name, Delete={"Objects": objects})
    s3_client.delete_bucket(Bucket=name)


@pytest.fixture
def memory_root():
    """A unique memory:// folder, removed after the test."""
    path = f"/ckptfmt-test-{uuid.uuid4().hex}"
    yield f"memory://{path}"
    fs = fsspec.filesystem("memory")
    if fs.exists(path):
        fs.rm(path, recursive=True)


BACKENDS = ["local", "memory", "s3"]


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    return request.param


@pytest.fixture
def root_url(backend, request, tmp_path) -> str:
    """An empty folder URL on each backend (nothing created yet)."""
    return make_root(backend, request, tmp_path)


@pytest.fixture
def repo_url(root_url) -> str:
    """A repository URL (not yet created) on each backend: local, memory://, S3."""
    return f"{root_url}/repo"


@pytest.fixture
def make_s3_proxy(s3_server):
    """A factory of fault-injecting proxies (tests/support/s3_fault_proxy.py) in front of the moto server.

    Each call starts one on a free port with faults off; all are stopped after the test.
    """
    from tests.support.s3_fault_proxy import FaultProxy

    proxies = []

    def make(seed: int = 0, stall_s: float = 1.0) -> FaultProxy:
        proxy = FaultProxy(s3_server, seed=seed, stall_s=stall_s).start()
        proxies.append(proxy)
        return proxy

    yield make
    for proxy in proxies:
        proxy.stop()


@pytest.fixture
def s3_proxy(make_s3_proxy):
    """One fault-injecting proxy in front of the moto server, faults off until the test turns them on."""
    return make_s3_proxy()


@pytest.fixture(scope="session")
def ddp_runs(tmp_path_factory):
    """Real gloo DDP runs with injected stragglers (tests/support/ddp_runs.py), each trained once per session, on
    first use, and shared by the modules that read them: ``ddp_runs["four"]`` is a repository URL."""
    from tests.support.ddp_runs import DdpRuns

    return DdpRuns(tmp_path_factory.mktemp("ddp-runs"))


@pytest.fixture
def hosts(request, tmp_path):
    """Simulated hosts (tests/support/hosts.py): 2 by default, ``@pytest.mark.parametrize("hosts", [4],
    indirect=True)`` for more. Where the machine cannot make them: a skip, and under CI a failure."""
    from tests.support.helpers import IN_CI
    from tests.support.hosts import HostsUnavailable, SimulatedHosts

    made = SimulatedHosts(getattr(request, "param", 2), tmp_path / "hosts")
    try:
        made.start()
    except HostsUnavailable as exc:
        (pytest.fail if IN_CI else pytest.skip)(f"no simulated hosts on this machine: {exc}")
    yield made
    made.close()


#: torch's deterministic-algorithms flags as the session found them.
_DETERMINISM = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())


@pytest.fixture(autouse=True)
def torch_determinism_restored():
    """Frameworks set process-wide torch flags (Lightning's ``deterministic=True`` turns deterministic
    algorithms on and never off, in a module's fixtures too): every test starts and ends with the
    session's flags."""
    torch.use_deterministic_algorithms(_DETERMINISM[0], warn_only=_DETERMINISM[1])
    yield
    torch.use_deterministic_algorithms(_DETERMINISM[0], warn_only=_DETERMINISM[1])


# -- markers: what each test needs (tests/support/markers.py) ------------------------------------
TESTS = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Markers that follow from where a test lives and what it uses: every test of tests/distributed/
    starts ranks, the S3 fixtures and an s3 backend parameter need the server, the shared DDP runs train
    on ranks. Other tests carry their markers themselves; tests/support/markers.py checks them all."""
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        callspec = getattr(item, "callspec", None)
        if item.path.is_relative_to(TESTS / "distributed") or "ddp_runs" in fixtures:
            item.add_marker(pytest.mark.distributed)
        if "s3_server" in fixtures or (callspec is not None and any(_names_s3(v) for v in callspec.params.values())):
            item.add_marker(pytest.mark.s3)


def _names_s3(parameter: object) -> bool:
    """Whether a test parameter picks the S3 backend (``"s3"``, or a pair of backends with it)."""
    return parameter == "s3" or (isinstance(parameter, tuple) and "s3" in parameter)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    markers.set_current(item)  # before any fixture: a session fixture set up for this test is this test's need


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item) -> None:
    markers.set_current(None)


# -- the repository stays as it was: tests write under tmp_path, never into the working tree ---------
_UNTRACKED = pytest.StashKey[set[str] | None]()


def _untracked() -> set[str] | None:
    """Untracked, unignored paths of the checkout (None outside a git checkout)."""
    result = subprocess.run(["git", "status", "--porcelain", "--untracked-files=normal"], cwd=TESTS.parent,
                            capture_output=True, text=True)
    if result.returncode != 0:
        return None
    return {line[3:] for line in result.stdout.splitlines() if line.startswith("?? ")}


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config.stash[_UNTRACKED] = _untracked()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    before = session.config.stash.get(_UNTRACKED, None)
    after = _untracked()
    if before is None or after is None or session.config.option.collectonly:
        return
    left = sorted(after - before)
    if left:
        writer = session.config.get_terminal_writer()
        writer.line()
        writer.line(f"tests left files in the working tree: {', '.join(left)}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED

