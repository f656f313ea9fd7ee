"""`python -m dofattn ...` is the `dofattn` command."""

import sys

from dofattn.cli import main

sys.exit(main())
