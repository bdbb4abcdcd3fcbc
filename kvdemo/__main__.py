"""``python -m kvdemo``: see :mod:`kvdemo.cli`."""

import sys

from .cli import main

sys.exit(main())
