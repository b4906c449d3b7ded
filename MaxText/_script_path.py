"""The one path fix for entry points that also run as scripts (`python MaxText/train.py`).

Run as a script, Python puts MaxText/ itself first on sys.path: `import MaxText` would then depend
on the package being installed, and the folders here (config, data, kernels, ...) would shadow
top-level packages of those names. Importing this module (the first import of such a script,
found through that very path entry) swaps MaxText/ for the repository root. Module runs
(`python -m MaxText.train`) never import it.
"""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE] + [os.path.dirname(_HERE)]
