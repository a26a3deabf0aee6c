"""``python -m ckptfmt.cli``: the same as the ``ckptfmt`` console script."""

import sys

from ckptfmt.cli import main

sys.exit(main())
