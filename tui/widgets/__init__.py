"""Widgets and renderables shared by the TUI's screens."""
