"""``python -m benchmarks.serving``: see the package docstring."""

import sys

from benchmarks.serving.cli import main

if __name__ == "__main__":
    sys.exit(main())
