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
