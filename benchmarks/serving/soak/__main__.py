"""``python -m benchmarks.serving.soak``: see the package docstring."""

import sys

from benchmarks.serving.soak.cli import main

if __name__ == "__main__":
    sys.exit(main())
