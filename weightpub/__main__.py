"""``python -m weightpub ...`` is the ``weightpub`` command."""

import sys

from weightpub.cli import main

sys.exit(main())
