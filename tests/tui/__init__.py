"""The terminal UI: Textual Pilot, snapshots, tmux."""
