"""The format (spec/): schemas and text against real files, hostile input, limits, fuzzing."""
