"""``python -m cpattn_testing.demo``: see :mod:`cpattn_testing.demo`."""

import sys

from cpattn_testing.demo.cli import main

sys.exit(main())
