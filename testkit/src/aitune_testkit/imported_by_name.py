"""A module no code imports: importing it sets AITUNE_TESTKIT_IMPORTED_BY_NAME, which a test looks for."""

import os

os.environ["AITUNE_TESTKIT_IMPORTED_BY_NAME"] = "1"


class Anything(tuple):
    """A named-tuple-like type a manifest can name."""

    _fields = ()
