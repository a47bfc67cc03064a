"""``python -m hexgen_worker``: see `hexgen_worker.cli`."""

import sys

from hexgen_worker.cli import main

if __name__ == "__main__":  # guarded: vLLM's engine core re-imports the main module
    sys.exit(main())
