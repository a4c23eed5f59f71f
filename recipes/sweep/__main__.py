"""``python -m recipes.sweep`` and ``accelerate launch -m recipes.sweep``: the sweep's command line."""

import sys

from recipes.sweep import main

if __name__ == "__main__":
    sys.exit(main())
