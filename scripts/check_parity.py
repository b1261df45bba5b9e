#!/usr/bin/env python3
"""Parity of apriel2-jax against a goldens-format directory. See ``apriel2_jax/parity.py``."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from apriel2_jax.cli.check_parity import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
