"""Entry point of ``python -m cupyflash`` (see :mod:`cupyflash._cli`)."""

import sys

from cupyflash._cli import main

if __name__ == "__main__":
    sys.exit(main())
