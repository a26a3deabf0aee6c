"""What the tests share: helpers, multi-process runs, fixtures' modules."""
