"""A child process building its share of a run's analytics tables (``table_build.build``, ``processes``)."""

from ckptfmt.analytics.processes import serve
from ckptfmt.analytics.table_build import build_share


def main(fd: int) -> None:
    """Build the share the caller wrote to stdin; the tables go into the file ``fd``."""
    serve(build_share, fd)
