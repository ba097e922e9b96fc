"""Demo: train LoRA policies with each adaptive-KL method side by side and show the difference.

    python blackwell/test_adaptive_kl_grpo.py            # embedded tiny model on CPU, 7 methods x 3 seeds
    python blackwell/test_adaptive_kl_grpo.py --quick    # smoke run, under a minute
    python blackwell/test_adaptive_kl_grpo.py --help     # all flags (--model NAME_OR_PATH for GPU users)

Not a pytest file: pytest collects only tests/. The implementation is `unsloth_adaptive_kl.tools.demo`.
"""

import sys

import unsloth_adaptive_kl  # noqa: F401  (first: patches trl, and Unsloth when imported after it)
from unsloth_adaptive_kl.tools.demo import main

if __name__ == "__main__":
    sys.exit(main())
