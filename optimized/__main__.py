"""`python -m optimized ...`: dispatches to optimized/cli/ (one module per subcommand)."""

import sys

from optimized.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
