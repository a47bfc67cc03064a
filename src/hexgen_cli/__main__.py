"""``python -m hexgen_cli``: the same as the ``hexgen-flow`` command."""

import sys

from hexgen_cli.main import main

sys.exit(main())
