"""`python -m ray_resume.cli`, as `ray-resume`."""

import sys

from . import main

sys.exit(main())
