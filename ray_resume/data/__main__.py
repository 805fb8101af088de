"""`python -m ray_resume.data synth ...`: write a synthetic dataset."""

import sys

from .synthetic import main

sys.exit(main())
