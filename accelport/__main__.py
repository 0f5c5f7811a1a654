"""``python -m accelport`` is the ``accelport`` command."""

import sys

from accelport.cli import main

sys.exit(main())
