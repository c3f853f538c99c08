"""``python -m jaxspec`` runs the command line (``jaxspec.cli``)."""

import sys

from jaxspec.cli import main

sys.exit(main())
