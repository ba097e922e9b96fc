"""`python -m unsloth_adaptive_kl`: the self-check (see selfcheck.py)."""

import sys

from .selfcheck import main

sys.exit(main())
