"""Every error aitune raises derives from :class:`AituneError`.

Each message says what went wrong and what to do about it, so callers can catch one base class and
users can act on the text alone.
"""

from __future__ import annotations


class AituneError(Exception):
    """Base class of every aitune error."""


class PluginError(AituneError):
    """A plugin could not be loaded or registered."""


class PluginLoadError(PluginError):
    """A plugin's entry point failed to import (raised under strict mode or when asked for)."""


class DuplicateBackendError(PluginError):
    """Two distributions registered a backend under the same name."""


class BackendNotFoundError(AituneError, LookupError):
    """No installed plugin provides the backend that was asked for."""


class BackendUnavailableError(AituneError):
    """The backend is installed but cannot run here (missing runtime, no device...)."""


class BackendNotImplementedError(AituneError, NotImplementedError):
    """The backend's distribution exists but this operation is not implemented yet."""


class ConfigError(AituneError, ValueError):
    """A configuration is invalid; the message names the offending path."""


class InputError(AituneError, ValueError):
    """Inputs given to aitune (dataset, samples, dynamic dims) are unusable."""


class UnsupportedValueError(InputError):
    """A call or output holds a value aitune cannot describe to a backend (a cache object, a callable)."""


class BuildError(AituneError):
    """A backend failed to build a candidate."""


class NotApplicableError(BuildError):
    """A candidate's variant does not apply to this module (an attention variant on a model with no
    attention config, a TorchScript trace of data-dependent control flow). The candidate is listed
    as "not applicable", not as a failure."""


class ValidationError(AituneError):
    """A candidate's outputs do not match eager PyTorch."""


class TuningError(AituneError):
    """Tuning could not produce a result the user asked for."""


class UnsupportedCallError(AituneError):
    """A tuned module in strict mode was called with inputs it was not tuned for."""


class InferenceOnlyError(UnsupportedCallError):
    """A tuned module in strict mode was called for training: in training mode, or with autograd needed."""


class StaleWeightsError(UnsupportedCallError):
    """A tuned module in strict mode was called after its weights changed, and its backend baked the old ones."""


class HooksChangedError(UnsupportedCallError):
    """Strict mode: hooks were added to the tuned module or a submodule after tuning (tuned backends do not run them)."""


class ServeStartError(AituneError):
    """``aitune serve`` could not load the model it was asked to serve (the message says why and what to do)."""


class ArtifactError(AituneError):
    """An artifact cannot be written or read (corrupt, tampered, incompatible...)."""


class ArtifactIntegrityError(ArtifactError):
    """An artifact's bytes are not the ones written: a digest differs, or a member name is hostile.

    Never loaded past, not even with ``fallback="eager"``.
    """


class SerializationError(ArtifactError):
    """A backend cannot save or load its payload."""


class DistributedTuneError(TuningError):
    """Ranks of a ``torch.distributed`` job could not tune together; ``rank`` is the one that failed.

    ``final``: no rank needs telling, because every rank raised it from the same exchange or the
    others cannot be reached; an enclosing step passes it on without another exchange.
    """

    def __init__(self, message: str, rank: int | None = None, final: bool = False) -> None:
        super().__init__(message)
        self.rank = rank
        self.final = final
