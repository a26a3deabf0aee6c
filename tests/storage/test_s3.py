"""S3 specifics (against a moto server): endpoint configuration, cross-client visibility, racing writers."""

from __future__ import annotations

import os
import threading

import pytest
import torch

import ckptfmt
from ckptfmt import CheckpointExistsError
from ckptfmt.format import layout
from ckptfmt.repository.repository import Repository
from ckptfmt.saving import pipeline
from tests.support.helpers import assert_same, run_in_threads


def bucket_keys(s3_client, bucket_url: str) -> set[str]:
    """Every object key in the bucket, listed with boto3 (independently of ckptfmt and s3fs)."""
    bucket = bucket_url.removeprefix("s3://")
    pages = s3_client.get_paginator("list_objects_v2").paginate(Bucket=bucket)
    return {o["Key"] for page in pages for o in page.get("Contents", [])}


def state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(300, 300, generator=g), "b": torch.randn(7, generator=g), "seed": seed}


def test_endpoint_from_the_environment(s3_server, s3_bucket, s3_client):
    """No storage_options at all: the endpoint and credentials come from AWS_* variables, as in a shell."""
    assert os.environ["AWS_ENDPOINT_URL"] == s3_server
    url = f"{s3_bucket}/runs/exp1"
    saved = state(1)
    assert ckptfmt.save(saved, f"{url}/step-1", step=1) == f"{url}/step-1"
    assert_same(saved, ckptfmt.load(f"{url}/step-1"))
    assert_same(saved, ckptfmt.load(url))
    report = ckptfmt.verify(url)
    assert report.ok and report.checkpoints == ["step-1"] and report.chunks_checked >= 1

    keys = bucket_keys(s3_client, s3_bucket)
    assert {"runs/exp1/ckptfmt.json", "runs/exp1/step-1/COMMIT"} <= keys
    assert any(k.startswith("runs/exp1/step-1/manifest-") for k in keys)
    assert any(k.startswith("runs/exp1/chunks/") for k in keys)


def test_endpoint_from_storage_options(s3_server, s3_bucket, s3_client, monkeypatch):
    """With no AWS_ENDPOINT_URL in the environment, explicit storage_options reach the server."""
    import s3fs

    monkeypatch.delenv("AWS_ENDPOINT_URL")
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    s3fs.S3FileSystem.clear_instance_cache()
    options = {"endpoint_url": s3_server, "key": "testing", "secret": "testing",
               "client_kwargs": {"region_name": "us-east-1"}}
    url = f"{s3_bucket}/explicit"
    try:
        saved = state(2)
        ckptfmt.save(saved, f"{url}/a", storage_options=options)
        assert_same(saved, ckptfmt.load(f"{url}/a", storage_options=options))
        with ckptfmt.open(url, storage_options=options) as reader:
            assert reader.name == "a"
            assert torch.equal(reader.get_tensor("b"), saved["b"])
        assert ckptfmt.verify(url, storage_options=options).ok
        ckptfmt.restore_rng(f"{url}/a", storage_options=options)
        assert "explicit/a/COMMIT" in bucket_keys(s3_client, s3_bucket)
    finally:
        s3fs.S3FileSystem.clear_instance_cache()  # the next test builds its client from the environment


def test_a_second_client_sees_new_commits(s3_bucket):
    """A reader's listing cache must not hide checkpoints another client committed since."""
    url = f"{s3_bucket}/shared"
    ckptfmt.save(state(1), f"{url}/a")
    reader_repo = Repository.open(url)
    assert reader_repo.names() == ["a"]

    other_client = {"skip_instance_cache": True}  # a separate S3FileSystem, like another process
    ckptfmt.save(state(2), f"{url}/b", storage_options=other_client)
    assert reader_repo.names() == ["a", "b"]
    assert reader_repo.latest() == "b"
    assert_same(state(2), ckptfmt.load(url))

    # And the other way round: deletions by another client are seen too.
    other = Repository.open(url, other_client)
    other.storage.delete(layout.commit_key("b"))
    assert reader_repo.names() == ["a"]


def test_racing_writers_one_commit_wins(s3_bucket, monkeypatch):
    """Two saves of one name pass the 'already exists?' check together; the conditional PUT of
    the commit record lets exactly one of them commit."""
    url = f"{s3_bucket}/race"
    ckptfmt.save({"x": 0}, f"{url}/base")
    barrier = threading.Barrier(2, timeout=60)
    original_commit = pipeline.commit_manifest

    def commit_together(repo, manifest, lease, *signer):
        barrier.wait()  # both saves have written chunks and manifests: now race for the commit
        original_commit(repo, manifest, lease, *signer)

    monkeypatch.setattr(pipeline, "commit_manifest", commit_together)
    outcomes: dict[int, object] = {}

    def save(seed: int) -> None:
        try:
            ckptfmt.save(state(seed), f"{url}/step-1", step=seed)
            outcomes[seed] = "committed"
        except BaseException as exc:
            outcomes[seed] = exc

    run_in_threads(lambda i: save((10, 20)[i]), 2)
    monkeypatch.undo()

    winners = [seed for seed, outcome in outcomes.items() if outcome == "committed"]
    losers = [outcome for outcome in outcomes.values() if outcome != "committed"]
    assert len(winners) == 1, outcomes
    assert len(losers) == 1 and isinstance(losers[0], CheckpointExistsError), outcomes
    loaded = ckptfmt.load(f"{url}/step-1")
    assert_same(state(winners[0]), loaded)
    assert ckptfmt.open(f"{url}/step-1").metadata["step"] == winners[0]
    assert ckptfmt.verify(url).ok
    assert Repository.open(url).names() == ["base", "step-1"]


def test_concurrent_writers_create_one_repository(s3_bucket):
    """Several first saves into a new repository at once: one marker, every checkpoint committed."""
    url = f"{s3_bucket}/fresh"
    barrier = threading.Barrier(4, timeout=60)
    errors = []

    def save(i: int) -> None:
        try:
            barrier.wait()
            ckptfmt.save(state(i), f"{url}/ckpt-{i}")
        except BaseException as exc:
            errors.append(exc)

    run_in_threads(save, 4)
    assert errors == []
    assert Repository.open(url).names() == [f"ckpt-{i}" for i in range(4)]
    for i in range(4):
        assert_same(state(i), ckptfmt.load(f"{url}/ckpt-{i}"))
    assert ckptfmt.verify(url).ok


@pytest.mark.parametrize("compression", [None, "shuffle-zstd"])
def test_chunks_larger_than_one_put_part(s3_bucket, compression):
    """Chunks of several MiB (uploaded as single PUTs) round trip and verify."""
    url = f"{s3_bucket}/big"
    saved = {"w": torch.arange(3 * 2**20, dtype=torch.int32)}  # 12 MiB
    ckptfmt.save(saved, f"{url}/a", chunk_size=8 * 2**20, compression=compression)
    assert_same(saved, ckptfmt.load(f"{url}/a"))
    assert ckptfmt.verify(url).ok
