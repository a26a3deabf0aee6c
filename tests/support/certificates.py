"""What the fault campaigns of ``certify`` assert of a certificate (tests/integrations/test_*_certify.py)."""

from __future__ import annotations

from ckptfmt.analytics.certify import Certificate


def assert_identical(certificate: Certificate, steps: int) -> None:
    """The run reproduces the reference bit for bit over ``steps`` steps."""
    assert (certificate.verdict, certificate.steps_compared) == ("identical", steps), certificate.to_json()


def assert_diverged_at(certificate: Certificate, step: int, cause: str, named: str) -> dict:
    """The run diverges first at ``step`` for ``cause``, a line of evidence naming ``named``; the first
    divergence is returned for what else a test checks."""
    divergence = certificate.first_divergence
    assert certificate.verdict == "diverged" and divergence is not None, certificate.to_json()
    assert (divergence["step"], divergence["cause"]) == (step, cause), certificate.to_json()
    assert any(named in line for line in divergence["evidence"]), divergence["evidence"]
    return divergence


def assert_restored_but_not_recomputed(certificate: Certificate) -> None:
    """A resume certified alone whose record says it restored every part, with no step computed again to
    compare: that is all it can say, so it cannot tell (a certificate that compared no step vouches for
    nothing that ran after the resume)."""
    parts = (certificate.resume or {}).get("parts") or []
    assert certificate.verdict == "undetermined" and certificate.steps_compared == 0, certificate.to_json()
    assert parts and all(part["verdict"] in ("equal", "not stored") for part in parts), parts
    assert "no step was computed again" in str(certificate.missing)
