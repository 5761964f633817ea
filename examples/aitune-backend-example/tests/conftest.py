"""The tests import their model by module name, as the fresh processes they start do."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
