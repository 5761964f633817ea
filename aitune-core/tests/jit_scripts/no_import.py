"""No aitune import that enables anything: JIT tuning must come from AITUNE_JIT=1 and the .pth hook."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import main

main()
