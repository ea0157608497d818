"""``python -m fedattr.cli``: the same as ``fedattr`` (and ``python -m fedattr``)."""

import sys

from . import main

sys.exit(main())
