"""Listing, latest and a save's parent lookup in a repository of many checkpoints on S3 (moto), with the
commit index (spec 4.4) and without it (every commit record read).

    python bench/s3_scale.py [--checkpoints 10000] [--threads 4]

Starts a moto S3 server on a free local port, saves one real checkpoint and
commits the others through the writer's last steps (a manifest, then
``Repository.create_commit``: index entry, commit record, read-backs,
compactions) from copies of the first one's manifest. Then times each operation
and counts the HTTP requests it sends (a botocore ``before-send`` hook), the
index used, then ignored. moto answers from memory on this machine: a real S3
endpoint adds its round trip (10-30 ms) to every request, so the request
counts are the figures that carry over. moto also scans every key of the
bucket for each listing request, where S3 reads only the listed range: each
save's listing of the index entries makes populating quadratic here (about
20 minutes for 10,000 checkpoints on 2 busy cores).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import logging
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from unittest import mock

import torch

import ckptfmt
from ckptfmt.cli import main
from ckptfmt.format import layout
from ckptfmt.format.hashing import chunk_hash
from ckptfmt.repository.repository import CommitRecord, Repository
from ckptfmt.saving.core import resolve_parent
from ckptfmt.saving.options import LATEST


def start_moto() -> str:
    """A moto S3 server on a free port, the AWS environment pointed at it, one bucket; its s3:// URL."""
    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1",
                      AWS_ENDPOINT_URL=f"http://{host}:{port}")
    boto3.client("s3").create_bucket(Bucket="scale")
    return "s3://scale/repo"


def populate(url: str, count: int, threads: int) -> Repository:
    """A repository of ``count`` checkpoints: one saved, the others committed from copies of its manifest."""
    ckptfmt.save({"w": torch.arange(4.0)}, f"{url}/seed", step=0)
    repo = Repository.open(url)
    repo.storage.create_settle_s = 0  # the read-backs still run; only their pause goes
    seed = repo.commit("seed")
    manifest = repo.manifest("seed", seed)

    def commit(i: int) -> None:
        copy = dataclasses.replace(manifest, name=f"c{i:06d}", step=i, created_ns=time.time_ns(), parent=None)
        data = copy.to_bytes()
        digest = chunk_hash(data)
        repo.storage.write(layout.manifest_key(copy.name, digest), data)
        repo.create_commit(CommitRecord(copy.name, digest, len(data), copy.step, copy.created_ns, None, copy.totals))

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(commit, range(1, count)))
    return repo


@contextlib.contextmanager
def counted(storage):
    """Counts the HTTP requests the storage's S3 client sends meanwhile: yields a one-item list."""
    count = [0]

    def note(**_):
        count[0] += 1

    events = storage.fs.s3.meta.events
    events.register("before-send.s3", note)
    try:
        yield count
    finally:
        events.unregister("before-send.s3", note)


def measure(storage, operation) -> tuple[float, int]:
    """Seconds and requests of one call of ``operation``."""
    with counted(storage) as count:
        started = time.perf_counter()
        operation()
        seconds = time.perf_counter() - started
    return seconds, count[0]


def ls(url: str) -> None:
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["ls", url, "--json"]) == 0


def run(count: int, threads: int) -> None:
    url = start_moto()
    started = time.perf_counter()
    repo = populate(url, count, threads)
    print(f"{count} checkpoints committed in {time.perf_counter() - started:.0f} s "
          f"({len(repo.index.packs())} packs, {len(repo.index.entries())} loose entries)\n")
    operations = {
        "ckptfmt ls --json": lambda: ls(url),
        "Repository.commits() (what ls lists)": lambda: Repository.open(url).commits(),
        "Repository.latest()": lambda: Repository.open(url).latest(),
        "parent lookup (core.resolve_parent)": lambda: resolve_parent(Repository.open(url), LATEST),
    }
    rows = []
    for name, operation in operations.items():
        indexed = measure(repo.storage, operation)
        with mock.patch.object(Repository, "indexed", property(lambda self: False)):
            full = measure(repo.storage, operation)
        rows.append((name, indexed, full))
    save = measure(repo.storage, lambda: ckptfmt.save({"w": torch.ones(4)}, f"{url}/one-more"))
    print(f"{'operation':40} {'index: s':>9} {'requests':>9}   {'no index: s':>11} {'requests':>9}")
    for name, (seconds, requests), (full_seconds, full_requests) in rows:
        print(f"{name:40} {seconds:9.2f} {requests:9d}   {full_seconds:11.2f} {full_requests:9d}")
    print(f"{'one more ckptfmt.save (index)':40} {save[0]:9.2f} {save[1]:9d}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoints", type=int, default=10_000)
    parser.add_argument("--threads", type=int, default=4, help="threads committing the checkpoints")
    args = parser.parse_args()
    sys.exit(run(args.checkpoints, args.threads))
