"""The ckptfmt command: output, exit codes, hostile repositories, diff."""
