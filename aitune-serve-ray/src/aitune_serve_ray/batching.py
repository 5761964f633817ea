"""One replica's model run on batches of requests, every call inside the tuned batch sizes.

The runner is every engine's (:class:`aitune.torch.serving.BatchRunner`: requests joined, cut into
calls of tuned sizes, padded, split back, each call observed); Ray Serve's ``serve.batch`` feeds it.
Here a request the model cannot take is answered with this engine's :class:`BadRequest` (a 422).
"""

from __future__ import annotations

from aitune.torch import serving

from .codec import BadRequest


class BatchRunner(serving.BatchRunner):
    """Runs the model on batches of checked requests (see :func:`aitune_serve_ray.codec.decode`)."""

    def client_error(self, message: str) -> BadRequest:
        return BadRequest(422, message)
