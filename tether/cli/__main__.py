"""``python -m tether.cli``: the ``tether`` command."""

import sys

from tether.cli.main import main

sys.exit(main())
