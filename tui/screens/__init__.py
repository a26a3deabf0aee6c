"""The TUI's screens: repository, checkpoint, verify, diff, and help."""
