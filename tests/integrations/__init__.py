"""The framework integrations (ckptfmt.integrations), against the real frameworks."""
