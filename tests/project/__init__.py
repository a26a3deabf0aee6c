"""The project's shape: architecture, import boundaries, public API, documented examples."""
