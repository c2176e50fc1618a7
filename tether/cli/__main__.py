"""``python -m common.cli``: the ``tether`` command."""

import sys

from common.cli.main import main

sys.exit(main())
