"""The save path: round trips, async saves, options, integrity, crashes at any moment."""
