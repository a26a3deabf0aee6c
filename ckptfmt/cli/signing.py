"""``ckptfmt keygen KEY [--algorithm A]`` and ``ckptfmt sign URL --key KEY``: keys (Ed25519, ML-DSA-65 or the
hybrid of both), and signatures of committed checkpoints (spec 10.3). Readers check them with ``verify
--trusted-key`` (and ``trusted_keys=``)."""

from __future__ import annotations

import argparse

from rich.console import Console

from ckptfmt.format.signatures import ALGORITHMS, DEFAULT_ALGORITHM
from ckptfmt.tools.formatting import counted
from ckptfmt.tools.output import Output


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("keygen", help="make a key pair to sign checkpoints with")
    p.add_argument("key", metavar="KEY", help="the private key's file (created, readable by you only); the public "
                                              "key goes to KEY.pub")
    p.add_argument("--algorithm", choices=list(ALGORITHMS), default=DEFAULT_ALGORITHM,
                   help="ed25519 (small, fast; the default), ml-dsa-65 (post-quantum, FIPS 204; format 2.0) or "
                        "ed25519+ml-dsa-65 (both: trusted only if both verify)")
    p.set_defaults(run=keygen_command)

    p = subparsers.add_parser("sign", help="sign a checkpoint, or every checkpoint of a repository")
    p.add_argument("url", help="checkpoint URL REPO/NAME, or a repository for all its checkpoints")
    p.add_argument("--key", required=True, metavar="KEY", help="the private key (PEM: ckptfmt keygen, or openssl "
                                                                "genpkey -algorithm ed25519)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(run=sign_command)


def keygen_command(args, console: Console) -> int:
    from ckptfmt.lifecycle.signing import generate_key  # imported when it runs: CLI startup

    private, public, key_id = generate_key(args.key, args.algorithm)
    out = Output(console)
    out.line(f"wrote the {args.algorithm} private key {private} (keep it secret) and the public key {public} "
             f"(give it to readers: --trusted-key, trusted_keys=); key id {key_id}")
    return 0


def sign_command(args, console: Console) -> int:
    from ckptfmt.lifecycle.signing import sign

    report = sign(args.url, args.key)
    if args.json:
        Output(console).json({"url": report.url, "key_id": report.key_id, "signed": report.signed,
                              "already_signed": report.already})
        return 0
    already = f"; {counted(len(report.already), 'checkpoint')} already signed by it" if report.already else ""
    Output(console).line(f"{report.url}: signed {counted(len(report.signed), 'checkpoint')} with key "
                         f"{report.key_id}{already}")
    return 0
