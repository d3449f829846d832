"""``python -m acb``: the ``acb`` command line (see :mod:`acb.cli`)."""

import sys

from acb.cli import main

if __name__ == "__main__":
    sys.exit(main())
