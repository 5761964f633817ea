"""The API for plugin authors: everything a backend, executor or deployment imports from aitune.

A plugin distribution (``aitune-backend-*``, ``aitune-executor-ray``, a third party's backend)
imports aitune only through this module, so that core's other modules stay free to change; a
deployment that runs tuned modules as a user does (``aitune-serve-ray``) also imports
``aitune.torch``. The names are the very objects of the modules they come from (``aitune.plugin.
BuildError is aitune.errors.BuildError``), so a user catching ``aitune.errors.BuildError`` catches
what a plugin raises. ``lint-imports`` (``.importlinter``, contracts ``plugins-use-public-api`` and
``plugin-api-stays-below-the-engine``) keeps plugins to this module and keeps this module's imports
below the engine, so importing a plugin never imports the tuner, the artifact code or the command
line. A plugin's tests may import ``aitune.testing`` (the conformance suite and test helpers) and
``aitune.torch`` besides.

The groups:

* registration: :data:`hookimpl` marks a plugin's hook functions; ``aitune_register_backends``
  gets a :class:`BackendRegistrar` (bound to the plugin's distribution) to add :class:`BackendSpec`
  entries to (``module_importable`` for a spec's probe), ``aitune_register_executors`` an
  :class:`ExecutorRegistrar` for :class:`ExecutorSpec` entries;
* the backend contract: :class:`Backend` and its frozen attrs :class:`BackendConfig`, the
  :class:`BuildContext` and :class:`LoadContext` its ``build`` and ``load`` get, its
  :class:`Tolerance` and the dtype defaults ``DEFAULT_TOLERANCES``, and the helpers
  ``exported_file`` and ``payload_file`` (file names from notes and metadata, checked),
  ``machine_cores`` and ``torch_allows_tf32``; ``owned_folder``, a private folder for the files a
  payload's runtime opens, removed with its owner and reclaimed after a process killed outright (its
  lock file, ``OWNER_FILE``, is left out of a copy); ``EXPORT_S``, the ``build_info`` key under which a
  backend states its export's seconds (the report's time breakdown);
* the graph a backend builds for: :class:`GraphSpec` (with its :class:`TensorSpec` inputs and
  their :class:`DimRange` dynamic sizes), a recorded call :class:`Sample`, ``resize`` (a sample at
  another batch size), :class:`FlatModule` (the module called with flat tensors), and ``tree``
  (``tree.flatten``/``tree.unflatten``: nested inputs and outputs as flat tensor lists);
* ONNX export, shared by the ONNX Runtime and TensorRT backends: :class:`ONNXExportConfig`,
  ``export_onnx`` and the :class:`ONNXExport` it returns, ``model_files`` and ``MODEL_FILE``;
  ``exclusive(module)``, what to trace the user's module as (a detached copy no other thread sees traced); ``EXPORTER_MODULES``,
  what an export imports (for ``Backend.warm_imports``);
* Inductor's compile cache (:mod:`aitune.compile_cache`), for every backend that compiles with
  Inductor (torch.compile, AOTInductor): ``inductor_cache`` around a build or a load (the checked,
  private ``<aitune cache>/inductor``, or the user's own ``TORCHINDUCTOR_CACHE_DIR``; ``inductor_cache_dir``
  names it), an :class:`InductorCacheSwitch` to that folder around each run-time call that may
  compile again, and ``inductor_options`` (the options every such compile gets); ``INDUCTOR_MODULES``,
  what a compile imports (for ``Backend.warm_imports``);
* executors (where isolated builds run): :class:`Executor`, the :class:`BuildRequest` it gets and
  the :class:`BuildHandle` it returns, ``worker_job`` (a build as JSON), and on the node that
  builds, ``job_on_this_node`` and ``run_job`` (run the worker), :class:`WorkerBuildError`;
* a plugin's own ``AITUNE_*`` variables: ``envvars`` (:mod:`aitune.envvars`), whose ``Variable``
  and parsers read every one, so a plugin's variables follow core's spellings and messages;
* errors a plugin raises (:mod:`aitune.errors`): :class:`BuildError`, :class:`ConfigError`,
  :class:`SerializationError`, :class:`ArtifactError`, :class:`BackendUnavailableError`,
  :class:`NotApplicableError`, :class:`InputError`.

A name is added here when a plugin needs it (``aitune-core/tests/test_architecture.py`` fails when a
plugin imports a name this module does not export), never by importing another core module.
"""

from __future__ import annotations

from . import envvars, hookimpl, tree
from .backend import (
    DEFAULT_TOLERANCES,
    EXPORT_S,
    Backend,
    BackendConfig,
    BuildContext,
    LoadContext,
    Tolerance,
    exported_file,
    machine_cores,
    payload_file,
    torch_allows_tf32,
)
from .compile_cache import INDUCTOR_MODULES, InductorCacheSwitch, inductor_cache, inductor_cache_dir, inductor_options
from .errors import (
    ArtifactError,
    BackendUnavailableError,
    BuildError,
    ConfigError,
    InputError,
    NotApplicableError,
    SerializationError,
)
from .executor import (
    BuildHandle,
    BuildRequest,
    Executor,
    ExecutorRegistrar,
    ExecutorSpec,
    WorkerBuildError,
    job_on_this_node,
    run_job,
    worker_job,
)
from .files import OWNER_FILE, owned_folder
from .graph import DimRange, FlatModule, GraphSpec, Sample, TensorSpec, resize
from .onnx_export import EXPORTER_MODULES, MODEL_FILE, ONNXExport, ONNXExportConfig, export_onnx, model_files
from .registry import BackendRegistrar, BackendSpec, module_importable
from .tracing import exclusive

__all__ = [  # grouped in the docstring above
    "DEFAULT_TOLERANCES",
    "EXPORTER_MODULES",
    "EXPORT_S",
    "INDUCTOR_MODULES",
    "MODEL_FILE",
    "OWNER_FILE",
    "ArtifactError",
    "Backend",
    "BackendConfig",
    "BackendRegistrar",
    "BackendSpec",
    "BackendUnavailableError",
    "BuildContext",
    "BuildError",
    "BuildHandle",
    "BuildRequest",
    "ConfigError",
    "DimRange",
    "Executor",
    "ExecutorRegistrar",
    "ExecutorSpec",
    "FlatModule",
    "GraphSpec",
    "InductorCacheSwitch",
    "InputError",
    "LoadContext",
    "NotApplicableError",
    "ONNXExport",
    "ONNXExportConfig",
    "Sample",
    "SerializationError",
    "TensorSpec",
    "Tolerance",
    "WorkerBuildError",
    "envvars",
    "exclusive",
    "export_onnx",
    "exported_file",
    "hookimpl",
    "inductor_cache",
    "inductor_cache_dir",
    "inductor_options",
    "job_on_this_node",
    "machine_cores",
    "model_files",
    "module_importable",
    "owned_folder",
    "payload_file",
    "resize",
    "run_job",
    "torch_allows_tf32",
    "tree",
    "worker_job",
]
