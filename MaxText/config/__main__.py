"""`python -m MaxText.config <config.yml> [key=value ...]`: print the resolved config (a dry run)."""

import sys

from MaxText.config import pyconfig

if __name__ == "__main__":
  config = pyconfig.initialize_or_exit(["python -m MaxText.config"] + sys.argv[1:], pyconfig.__doc__)
  print(pyconfig.to_yaml(config), end="")
