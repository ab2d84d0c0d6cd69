"""`python -m inferencemesh`: the same as the `inferencemesh` console script."""

import sys

from inferencemesh.programs.cli import main

sys.exit(main())
