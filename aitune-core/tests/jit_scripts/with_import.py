"""JIT on by its import, the way the docs say: the first import of the script."""

import aitune.torch.jit.enable  # noqa: F401, I001

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import main

main()
