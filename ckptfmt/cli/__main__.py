"""``python -m ckptfmt.cli``: the same as the ``ckptfmt`` console script."""

import sys

from . import main

sys.exit(main())
