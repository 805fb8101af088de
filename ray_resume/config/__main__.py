"""`python -m ray_resume.config schema`: the JSON Schema of a config file, for an editor's YAML language server."""

import json
import sys

from .files import json_schema

if sys.argv[1:] != ["schema"]:
    sys.exit("usage: python -m ray_resume.config schema    # print the JSON Schema of a config file")
print(json.dumps(json_schema(), indent=1))
