"""`python -m unsloth_adaptive_kl`: the self-check (see tools/selfcheck.py)."""

import sys

from .tools.selfcheck import main

sys.exit(main())
