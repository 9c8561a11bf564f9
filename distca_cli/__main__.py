"""``python -m distca_cli``: the same as the ``distca`` console script."""

import sys

from distca_cli import main

sys.exit(main())
