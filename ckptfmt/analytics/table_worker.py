"""A child process building its share of a run's analytics tables (``tables.build``): ``python -m``."""

from ckptfmt.analytics.processes import serve
from ckptfmt.analytics.tables import build_share

if __name__ == "__main__":
    serve(build_share)
