"""ckptfmt's test suite: one folder per area, shared code in support/, launched programs in scripts/."""
