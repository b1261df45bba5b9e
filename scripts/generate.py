#!/usr/bin/env python3
"""Generate with an Apriel2 checkpoint on the serving engine. See ``apriel2_jax/cli/generate.py``."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from apriel2_jax.cli.generate import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
