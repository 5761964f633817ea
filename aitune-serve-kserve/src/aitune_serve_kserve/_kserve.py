"""kserve, imported with a clean ``sys.argv``.

``kserve.model_server`` parses the process's command line with argparse when it is imported (its
defaults for ``ModelServer``): under ``aitune serve`` it would read aitune's own options (argparse
takes abbreviations, so ``--pr`` would be kserve's ``--protocol``). Every kserve import of this
package goes through here, so kserve sees its defaults and aitune passes what it means explicitly.
"""

from __future__ import annotations

import sys

_argv = sys.argv
sys.argv = _argv[:1]
try:
    from kserve import Model, ModelServer
    from kserve.constants.constants import INFERENCE_CONTENT_LENGTH_HEADER
    from kserve.errors import InvalidInput, ModelNotReady
    from kserve.model_server import app as rest_app
    from kserve.protocol.dataplane import DataPlane
    from kserve.protocol.infer_type import InferInput, InferOutput, InferRequest, InferResponse
finally:
    sys.argv = _argv

__all__ = [
    "INFERENCE_CONTENT_LENGTH_HEADER",
    "DataPlane",
    "InferInput",
    "InferOutput",
    "InferRequest",
    "InferResponse",
    "InvalidInput",
    "Model",
    "ModelNotReady",
    "ModelServer",
    "rest_app",
]
