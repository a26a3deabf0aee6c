"""What each signature algorithm costs (spec 10.3): Ed25519, ML-DSA-65 and the hybrid of both.

Usage (from the repository root)::

    python bench/signing.py [--repeats 201] [--opens 51] [--json PATH]

Per algorithm, the median (and the 10th-90th percentile range) over ``--repeats`` of: making a key
(``SigningKey.generate``), signing a commit record (``SigningKey.sign``: the signature object as a save or
``ckptfmt sign`` writes it) and verifying it under the trusted key (``Signature.verifies``, what a reader
with ``trusted_keys=`` does per checkpoint); the sizes of the raw public key, the signature, the signature
object and the PEM key files. Then what trust adds to opening a small checkpoint: ``ckptfmt.open`` with
``trusted_keys=`` against without, ``--opens`` pairs in alternating order, the median of the per-pair
differences (listing the folder, reading the object, verifying). Pure CPU: the cryptography package's
implementations, one thread.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

import ckptfmt
from ckptfmt.format.commit_record import CommitRecord
from ckptfmt.format.signatures import ALGORITHMS, SigningKey

RECORD = CommitRecord(name="step-001000", manifest_hash="ab" * 32, manifest_size=123456, step=1000,
                      created_ns=1_796_627_851_717_058_221, parent="step-000900", totals={})


def timed(fn, repeats: int) -> list[float]:
    """Each call's wall time in microseconds."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        fn()
        times.append((time.perf_counter_ns() - start) / 1e3)
    return times


def summary(times: list[float]) -> dict:
    """The median and the 10th-90th percentile range, in microseconds."""
    deciles = statistics.quantiles(times, n=10)
    return {"median_us": round(statistics.median(times), 1), "p10_us": round(deciles[0], 1),
            "p90_us": round(deciles[-1], 1)}


def measure(algorithm: str, repeats: int) -> dict:
    """Key generation, signing and verification times and the sizes of one algorithm."""
    key = SigningKey.generate(algorithm)
    signature = key.sign(RECORD)
    assert signature.verifies(RECORD, key.public_key)
    return {
        "keygen": summary(timed(lambda: SigningKey.generate(algorithm), repeats)),
        "sign": summary(timed(lambda: key.sign(RECORD), repeats)),
        "verify": summary(timed(lambda: signature.verifies(RECORD, key.public_key), repeats)),
        "public_key_bytes": len(key.public_key), "signature_bytes": len(signature.signature),
        "object_bytes": len(signature.to_bytes()), "private_pem_bytes": len(key.private_pem()),
        "public_pem_bytes": len(key.public_pem()),
    }


def open_cost(algorithm: str, opens: int, folder: Path) -> dict:
    """What ``trusted_keys=`` adds to ``ckptfmt.open`` of a small signed checkpoint, per pair."""
    key = folder / algorithm
    ckptfmt.generate_key(key, algorithm=algorithm)
    url = folder / f"repo-{algorithm}" / "a"
    ckptfmt.save({"w": torch.ones(1024)}, url, step=1, signer=key)
    trusted = f"{key}.pub"

    def open_once(**kwargs) -> float:
        start = time.perf_counter_ns()
        ckptfmt.open(url, **kwargs).close()
        return (time.perf_counter_ns() - start) / 1e3

    differences = []
    for pair in range(opens):
        if pair % 2:
            plain, signed = open_once(), open_once(trusted_keys=trusted)
        else:
            signed, plain = open_once(trusted_keys=trusted), open_once()
        differences.append(signed - plain)
    return summary(differences)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=201)
    parser.add_argument("--opens", type=int, default=51)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for algorithm in ALGORITHMS:
            results[algorithm] = measure(algorithm, args.repeats)
            results[algorithm]["open_with_trust"] = open_cost(algorithm, args.opens, Path(tmp))
            row = results[algorithm]
            print(f"{algorithm:>18}: keygen {row['keygen']['median_us']:8.1f} us, sign {row['sign']['median_us']:8.1f}"
                  f" us, verify {row['verify']['median_us']:8.1f} us, open + trust +"
                  f"{row['open_with_trust']['median_us']:8.1f} us; public key {row['public_key_bytes']} B, "
                  f"signature {row['signature_bytes']} B, object {row['object_bytes']} B, key files "
                  f"{row['private_pem_bytes']} + {row['public_pem_bytes']} B")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
