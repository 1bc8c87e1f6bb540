"""Storage backends by URL scheme: one module registers one :class:`BackendSpec`, and everything
distckpt knows per backend is read from the registry (the pattern of fsspec's
``register_implementation`` / ``known_implementations``).

A spec says which URL schemes a backend opens and the factory that opens a root, whether its
commit marker is created exclusively, what the URL's first component names (a bucket, a
container), and what the rest of the package must know of its client library: the packages
whose exceptions are the store's answers (they become :class:`~distckpt.StorageError`), the
``pip install`` advice when one is missing, the modules whose retry jitter is kept off the
process's global ``random`` stream (jitter.py), the environment variables that hold secrets
(redacted from every log record, redact.py) and the prefixes of the environment that feeds its
credentials (a change gives a new shared client, clients.py). ``client_errors`` names exception
classes that are the store's answers wherever they are defined (an error class of a wrapper
module, not of ``client_packages``): they become StorageError too.

How to add a backend
--------------------
1. Write one module, ``distckpt/storage/<name>.py``: a class meeting the ``Storage`` protocol
   (storage/base.py; for an fsspec client, subclass ``FsspecStorage`` (fsspec_fs.py) or, for an
   object store with a conditional create, ``ConditionalCreateStorage`` (conditional.py)), and
   at its end::

       register_backend(BackendSpec(
           name="mystore", schemes=("mystore",), open=open_mystore, exclusive_create=True,
           container="bucket", client_packages=("mystorefs",),
           install_hint="pip install mystorefs", jitter_modules=(), secret_env=("MYSTORE_KEY",),
           secret_options=("key",), credential_env_prefixes=("MYSTORE_",), selected_by=()))

   ``open(url, storage_options)`` receives the URL already checked by ``normalize_url`` and
   imports the client library inside (it is an optional dependency: an ImportError of one of
   ``client_packages`` becomes a ConfigError carrying ``install_hint``).
2. Add the backend's fixture to ``CONTRACT_FIXTURES`` in tests/test_storage_contract.py: the
   storage contract suite runs over every registered backend, and fails for one that has none.

Nothing else changes: every module of this package is imported the first time the registry is
asked (``backends()``), so the new module's scheme is dispatched by ``open_storage``. A backend
kept outside distckpt declares an entry point of the group ``distckpt.backends`` (its module, or
its BackendSpec) in its distribution's metadata; it is imported with the builtins, in every
process, the command line included. Calling ``register_backend`` before a manager is opened
works too, in that process only.

This module never imports torch.distributed.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import re
import sys
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping

from distckpt.errors import ConfigError, shown
from distckpt.runtime.plugins import BACKENDS_GROUP, load_plugins

if TYPE_CHECKING:
    from distckpt.storage.base import Storage

LOCAL_PATH = ""  # the scheme of a path written without one: a local path, taken literally
_SCHEME_SHAPE = re.compile(r"[a-z][a-z0-9+.\-]+")  # lower case, two characters at least (C: is a drive)
_ERROR_PATH = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*[.:][A-Za-z_]\w*")  # module.Class or module:Class


@dataclass(frozen=True)
class BackendSpec:
    """Everything distckpt knows of one storage backend. Every field is given, none defaulted:
    a backend states each fact, even that it has none of a kind (an empty tuple)."""

    name: str  # short and unique: messages, and the contract suite's fixture of it
    schemes: tuple[str, ...]  # the URL schemes it opens; LOCAL_PATH for plain paths; () = every other scheme
    open: Callable[[str, dict[str, Any]], Storage]  # (checked URL, storage_options) -> the root's Storage
    exclusive_create: bool  # COMMITTED created atomically against a second writer (else warned about)
    container: str | None  # what the URL's first component names ("bucket"); None: it is a path
    client_packages: tuple[str, ...]  # top-level modules of its client: its exceptions are the store's answers
    install_hint: str  # what to run when one of client_packages is missing ("" when nothing is installed)
    jitter_modules: tuple[str, ...]  # modules whose retry jitter draws from the global `random` (jitter.py)
    secret_env: tuple[str, ...]  # environment variables holding secrets, redacted from logs (redact.py)
    secret_options: tuple[str, ...]  # storage_options (or their client_kwargs) holding secrets, likewise
    credential_env_prefixes: tuple[str, ...]  # environment its client reads credentials from (clients.py)
    selected_by: tuple[tuple[str, Any], ...]  # storage_options that pick it over another of its schemes
    # The client's own exception classes, or their import paths ("mystorefs.errors.MyStoreError",
    # resolved only once that module is imported): each is the store's answer and becomes a
    # StorageError, wherever the class is defined. The one field with a default, so a backend
    # written before it still registers.
    client_errors: tuple[type[BaseException] | str, ...] = ()

    def __post_init__(self) -> None:
        problems = [f"{f.name}={shown(getattr(self, f.name))}: {why}" for f in dataclasses.fields(self)
                    for why in [_field_problem(f.name, getattr(self, f.name))] if why]
        if problems:
            raise ConfigError(f"BackendSpec({shown(self.name)}): " + "; ".join(problems))

    @property
    def is_fallback(self) -> bool:
        """Whether it opens every scheme no other backend claims (the generic fsspec one)."""
        return not self.schemes


def _field_problem(name: str, value: Any) -> str:
    """Why a spec's field is malformed ("" if it is not)."""
    strings = isinstance(value, tuple) and all(isinstance(v, str) and v for v in value)
    if name == "name":
        return "" if isinstance(value, str) and _SCHEME_SHAPE.fullmatch(value.replace("_", "-")) else "a lower-case word"
    if name == "schemes":
        ok = isinstance(value, tuple) and all(v == LOCAL_PATH or (isinstance(v, str) and _SCHEME_SHAPE.fullmatch(v))
                                              for v in value)
        return "" if ok and len(set(value)) == len(value) else "a tuple of distinct lower-case URL schemes ('' = a plain path)"
    if name == "open":
        return "" if callable(value) else "a callable (url, storage_options) -> Storage"
    if name == "exclusive_create":
        return "" if isinstance(value, bool) else "True or False"
    if name == "container":
        return "" if value is None or (isinstance(value, str) and value) else "a word such as 'bucket', or None"
    if name == "install_hint":
        return "" if isinstance(value, str) else "a str"
    if name == "client_errors":
        ok = isinstance(value, tuple) and all(
            (isinstance(v, type) and issubclass(v, BaseException)) or (isinstance(v, str) and _ERROR_PATH.fullmatch(v))
            for v in value)
        return "" if ok else "a tuple of exception classes or their import paths ('package.module.ErrorClass')"
    if name == "selected_by":
        ok = isinstance(value, tuple) and all(isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) for p in value)
        return "" if ok else "a tuple of (storage option, value) pairs"
    return "" if strings else "a tuple of non-empty str"


_LOCK = threading.RLock()
_SPECS: dict[str, BackendSpec] = {}
_discovered = False


def register_backend(spec: BackendSpec, *, replace: bool = False) -> BackendSpec:
    """Add `spec` to the registry (returns it). ConfigError if its name, or one of its schemes with
    the same `selected_by`, is already registered by another backend, unless `replace`."""
    if not isinstance(spec, BackendSpec):
        raise ConfigError(f"register_backend({shown(spec)}): takes a BackendSpec")
    with _LOCK:
        clashes = [other.name for other in _SPECS.values() if other.name != spec.name and _overlap(spec, other)]
        if clashes or (spec.name in _SPECS and not replace):
            what = f"the schemes {spec.schemes or 'of the fallback'} of {clashes}" if clashes else "the name"
            raise ConfigError(f"backend {shown(spec.name)}: {what} already registered; choose another "
                              "name or scheme, or pass replace=True to take its place")
        _SPECS[spec.name] = spec
    return spec


def unregister_backend(name: str) -> None:
    """Remove the backend named `name` (absent is fine)."""
    with _LOCK:
        _SPECS.pop(name, None)


def _overlap(a: BackendSpec, b: BackendSpec) -> bool:
    if a.is_fallback or b.is_fallback:
        return a.is_fallback and b.is_fallback
    return bool(set(a.schemes) & set(b.schemes)) and dict(a.selected_by) == dict(b.selected_by)


def backends() -> tuple[BackendSpec, ...]:
    """Every registered backend (this package's own are imported on the first call)."""
    _discover()
    with _LOCK:
        return tuple(_SPECS.values())


def _discover() -> None:
    """Import every module of distckpt.storage once: each backend module registers its spec; then
    the plugins of the entry point group ``distckpt.backends`` (runtime/plugins.py): a module that
    registers its spec when imported, or a BackendSpec, registered here."""
    global _discovered
    if _discovered:
        return
    import distckpt.storage as package

    for module in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{package.__name__}.{module.name}")
    _discovered = True  # before the plugins: one that asks the registry while imported sees the builtins
    try:
        for plugin in load_plugins(BACKENDS_GROUP):
            if isinstance(plugin, BackendSpec) and _SPECS.get(plugin.name) is not plugin:
                register_backend(plugin)
    except BaseException:
        _discovered = False  # asked again, the broken plugin is said again
        raise


def spec_named(name: str) -> BackendSpec:
    for spec in backends():
        if spec.name == name:
            return spec
    raise KeyError(name)


def registered_schemes() -> frozenset[str]:
    """Every scheme a backend claims (LOCAL_PATH included)."""
    return frozenset(s for spec in backends() for s in spec.schemes)


def backend_for(scheme: str, storage_options: Mapping[str, Any]) -> BackendSpec:
    """The backend that opens `scheme` with these options: among the backends claiming the scheme,
    the one whose `selected_by` options are all given, else the one that needs none; the
    fallback for a scheme nobody claims."""
    specs = backends()
    claiming = [s for s in specs if scheme in s.schemes]
    chosen = [s for s in claiming if s.selected_by and all(storage_options.get(k) == v for k, v in s.selected_by)]
    plain = [s for s in claiming if not s.selected_by]
    found = chosen or plain or [s for s in specs if s.is_fallback]
    if not found:
        raise ConfigError(f"no storage backend opens {shown(scheme)} URLs (registered: "
                          f"{', '.join(sorted(registered_schemes() - {LOCAL_PATH}))})")
    return found[0]


# -- what the rest of the storage package reads from the registry -------------------------------

def client_error_modules() -> frozenset[str]:
    """Top-level modules whose exceptions are a store's answer, not a defect (fsspec_fs.py)."""
    return frozenset(p for spec in backends() for p in spec.client_packages)


def client_error_classes() -> tuple[type[BaseException], ...]:
    """Every registered backend's `client_errors` whose module is imported (a class of a module
    never imported cannot have been raised, so none is imported here)."""
    found: list[type[BaseException]] = []
    for spec in backends():
        for entry in spec.client_errors:
            if isinstance(entry, type):
                found.append(entry)
                continue
            module_name, _, class_name = entry.replace(":", ".").rpartition(".")
            module = sys.modules.get(module_name)
            candidate = getattr(module, class_name, None) if module is not None else None
            if isinstance(candidate, type) and issubclass(candidate, BaseException):
                found.append(candidate)
    return tuple(found)


def is_client_error(error: BaseException) -> bool:
    """Whether `error` is a store's answer (a registered client's exception), not a defect."""
    return (type(error).__module__.partition(".")[0] in client_error_modules()
            or isinstance(error, client_error_classes()))


def secret_environment() -> tuple[str, ...]:
    """Environment variables whose values are redacted from every log record (redact.py)."""
    return tuple(dict.fromkeys(v for spec in backends() for v in spec.secret_env))


def secret_options() -> tuple[str, ...]:
    """Storage option names whose values are redacted from every log record (redact.py)."""
    return tuple(dict.fromkeys(v for spec in backends() for v in spec.secret_options))


def credential_environment_prefixes() -> tuple[str, ...]:
    """Environment variable prefixes a client reads credentials or endpoints from (clients.py)."""
    return tuple(dict.fromkeys(p for spec in backends() for p in spec.credential_env_prefixes))
