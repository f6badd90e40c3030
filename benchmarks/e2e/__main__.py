"""``python -m benchmarks.e2e``: see the package docstring."""

import sys

from benchmarks.e2e.cli import main

if __name__ == "__main__":
    sys.exit(main())
