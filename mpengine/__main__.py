"""``python -m mpengine``: the ``mpengine`` command."""

import sys

from mpengine.cli import main

if __name__ == "__main__":
    sys.exit(main())
