"""`python -m ray_resume.config schema`: the JSON Schema of a config file, for an editor's YAML language
server; `python -m ray_resume.config reference`: docs/config.md, the same keys for people."""

import json
import sys

from .files import json_schema
from .reference import markdown

if sys.argv[1:] == ["schema"]:
    print(json.dumps(json_schema(), indent=1))
elif sys.argv[1:] == ["reference"]:
    print(markdown(), end="")
else:
    sys.exit(
        "usage: python -m ray_resume.config schema | reference    # the JSON Schema of a config file | docs/config.md"
    )
