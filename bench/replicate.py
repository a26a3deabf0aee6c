"""Replication throughput, local disk to S3 (a moto server in its own process), and what verifying costs.

    python bench/replicate.py [--mib 300] [--chunk-mib 64] [--workers 8]

Saves one checkpoint of about ``--mib`` MB of float32 tensors to a local
repository, then copies it with ``ckptfmt.lifecycle.replicate``: to S3 with and without
``verify`` (reading each chunk back after writing it), to another local
repository, and once more to S3 when nothing is missing. Prints MB/s per run.
moto keeps objects in memory and runs on the same machine: its figures bound
ckptfmt's own overhead, not what a real S3 link would give.
"""

from __future__ import annotations

import argparse
import tempfile
import uuid

import torch
from harness import start_moto

import ckptfmt
from ckptfmt.lifecycle.replicate import replicate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=300, help="checkpoint size in MiB (float32 tensors of 16 MiB)")
    parser.add_argument("--chunk-mib", type=int, default=64, help="chunk size of the save")
    parser.add_argument("--workers", type=int, default=8)
    args = parser.parse_args()
    server, endpoint = start_moto()
    try:
        import boto3

        bucket = f"bench-{uuid.uuid4().hex[:12]}"
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
        with tempfile.TemporaryDirectory() as tmp:
            state = {f"t{i}": torch.randn(4 * 2**20) for i in range(max(1, args.mib // 16))}
            ckptfmt.save(state, f"{tmp}/src/step-1", chunk_size=args.chunk_mib * 2**20)
            del state
            runs = [("local -> s3, verify", f"s3://{bucket}/verified", True),
                    ("local -> s3, no verify", f"s3://{bucket}/unverified", False),
                    ("local -> local, verify", f"{tmp}/dst", True),
                    ("local -> s3, nothing missing", f"s3://{bucket}/verified", True)]
            seconds = {}
            for label, dst, verify in runs:
                report = replicate(f"{tmp}/src", dst, workers=args.workers, verify=verify)
                seconds[label] = report.seconds
                rate = report.bytes_copied / report.seconds / 1e6
                print(f"{label:30s} {report.chunks_copied:4d} chunks {report.bytes_copied / 1e6:8.1f} MB "
                      f"{report.seconds:7.2f} s {rate:8.1f} MB/s")
            assert ckptfmt.verify(f"s3://{bucket}/verified").ok
            cost = seconds["local -> s3, verify"] / seconds["local -> s3, no verify"] - 1
            print(f"verify on arrival costs {cost * 100:.0f} % more time to S3 (one GET per chunk written)")
    finally:
        server.kill()
        server.wait()


if __name__ == "__main__":
    main()
