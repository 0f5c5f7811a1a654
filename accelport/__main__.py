"""``python -m accelport`` is the ``accelport`` command."""

import sys

from .cli import main

sys.exit(main())
