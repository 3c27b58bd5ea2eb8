"""``python -m mpengine.cli``, as the ``mpengine`` command."""

import sys

from mpengine.cli import main

sys.exit(main())
