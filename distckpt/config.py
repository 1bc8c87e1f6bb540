"""The manager's settings: a small frozen object validated at construction.

Every constructor argument of CheckpointManager is one field here, checked with its name and
what to pass (ConfigError), so that nothing raw (TypeError, OverflowError, a silent truthy
string) escapes from deeper in the code. SETTINGS lists them for the one test that covers all.
"""

from __future__ import annotations

import datetime
import difflib
import functools
import inspect
import math
import numbers
import signal
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, TypeVar

from distckpt.errors import ArgumentNameError, ConfigError, shown

MIN_TIMEOUT_S = 0.001
MAX_TIMEOUT_S = 30 * 24 * 3600.0  # beyond this a deadline is a mistake (and overflows C++ timers)
DEFAULT_TIMEOUT_S = 600.0
_UNCATCHABLE = {signal.SIGKILL, signal.SIGSTOP}


@dataclass(frozen=True)
class ManagerConfig:
    keep_last: int | None = None
    keep_best: int | None = None
    best_mode: str = "min"
    async_save: bool = False
    timeout: float = DEFAULT_TIMEOUT_S
    leftover_grace_s: float = 3600.0
    world_size_policy: str = "refuse"
    split_writes: bool | None = None  # None: decided from the URL and the nodes (protocol/split_default.py)
    allow_dtype_cast: bool = False
    missing_entries: str = "refuse"
    preemption_signals: tuple[int, ...] = field(default=(signal.SIGTERM,))
    incremental: bool = False
    overlap_snapshot: bool = False
    # PEM bytes or text, a path, or None (then DISTCKPT_SIGNING_KEY / DISTCKPT_VERIFY_KEY); parsed,
    # and compared across ranks by fingerprint, in protocol/settings.py (io/signing.py). Never shown.
    signing_key: Any = field(default=None, repr=False)
    verify_key: Any = field(default=None, repr=False)
    writer: str = "thread"
    staging_bytes: int | None = None

    def shared_settings(self) -> dict[str, Any]:
        """The settings every rank must share (compared when the manager is built): all but the
        timeout and the signals, which act on each process alone, and the keys (compared by
        their fingerprints: Settings.shared)."""
        return {name: list(value) if isinstance(value, tuple) else value for name, value in asdict(self).items()
                if name not in ("timeout", "preemption_signals", "signing_key", "verify_key")}

    def __post_init__(self) -> None:
        for name in ("keep_last", "keep_best"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1):
                raise ConfigError(f"{name}={shown(value)}: must be a positive int or None (keep all)")
            if value is not None:
                object.__setattr__(self, name, int(value))  # a NumPy integer, as keep_local and step take
        _choice("best_mode", self.best_mode, ("min", "max"))
        for name in ("async_save", "split_writes", "allow_dtype_cast", "incremental", "overlap_snapshot"):
            if not isinstance(getattr(self, name), bool) and not (name == "split_writes" and self.split_writes is None):
                raise ConfigError(f"{name}={shown(getattr(self, name))}: must be True or False"
                                  + (" (or None: on for remote storage across several nodes)"
                                     if name == "split_writes" else ""))
        object.__setattr__(self, "timeout", seconds("timeout", self.timeout, default=DEFAULT_TIMEOUT_S))
        if self.world_size_policy not in ("refuse", "reshard", "replicated_only", "elastic"):
            raise ConfigError(f"world_size_policy={shown(self.world_size_policy)}: must be 'refuse' (default), "
                              "'reshard' (restore replicated and sharded state at another world size, keep "
                              "this run's per-rank state; 'replicated_only' is its older name) or 'elastic' "
                              "(as 'reshard', and continue the interrupted epoch's sample order)")
        grace = self.leftover_grace_s
        if isinstance(grace, bool) or not isinstance(grace, numbers.Real) or not (0 <= grace < math.inf):
            raise ConfigError(f"leftover_grace_s={shown(grace)}: must be a finite number of seconds >= 0")
        try:
            object.__setattr__(self, "leftover_grace_s", float(grace))
        except OverflowError:  # an int past float's range: no finite number of seconds
            raise ConfigError(f"leftover_grace_s={shown(grace)}: must be a finite number of seconds >= 0") from None
        _choice("missing_entries", self.missing_entries, ("refuse", "keep"))
        object.__setattr__(self, "preemption_signals", signals("preemption_signals", self.preemption_signals))
        if self.overlap_snapshot and not self.async_save:
            raise ConfigError("overlap_snapshot=True needs async_save=True: the snapshot it overlaps with "
                              "training is the async save's copy into host memory")
        check_writer_settings(self)


def check_writer_settings(config: ManagerConfig) -> None:
    """writer= and staging_bytes= (protocol/writer_process.py, protocol/bounded_staging.py), and
    the combinations refused by name: both act on the background write of async saves only, and
    a bound on staging makes save() wait while tensors are read in place, which a snapshot
    overlapped with training (it copies after save() returned) cannot do."""
    _choice("writer", config.writer, ("thread", "process"))
    value = config.staging_bytes
    if value is not None:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ConfigError(f"staging_bytes={shown(value)}: must be a positive int (bytes of host staging per "
                              "rank, e.g. 2 << 30) or None (no bound)")
        object.__setattr__(config, "staging_bytes", int(value))
    for name, on in (("writer='process'", config.writer == "process"), ("staging_bytes", value is not None)):
        if on and not config.async_save:
            raise ConfigError(f"{name} needs async_save=True: it shapes the background write of async saves, "
                              "and a synchronous save writes from the training thread itself")
    if value is not None and config.overlap_snapshot:
        raise ConfigError("staging_bytes with overlap_snapshot=True is not supported: a bounded staging makes "
                          "save() wait while the part over the bound is written, the overlapped snapshot defers "
                          "the copies until after save() returned; use one of the two")


def _choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if not isinstance(value, str) or value not in allowed:
        raise ConfigError(f"{name}={shown(value)}: must be one of {', '.join(repr(a) for a in allowed)}")


def seconds(name: str, value: Any, default: float | None = None) -> float:
    """A positive, finite number of seconds from a number or a datetime.timedelta (as
    torch.distributed takes it); None gives `default` where there is one."""
    if value is None and default is not None:
        return default
    if isinstance(value, datetime.timedelta):
        value = value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigError(f"{name}={shown(value)}: must be a number of seconds or a datetime.timedelta")
    try:
        value = float(value)
    except OverflowError:
        value = math.inf
    if not MIN_TIMEOUT_S <= value <= MAX_TIMEOUT_S:
        raise ConfigError(f"{name}={shown(value)}: must be at least {MIN_TIMEOUT_S} s and at most {MAX_TIMEOUT_S:.0f} s "
                          "(30 days): every collective needs a finite deadline, and gloo counts it in whole "
                          "milliseconds (less than one is 0)")
    return value


def signals(name: str, value: Any) -> tuple[int, ...]:
    """Signals as numbers, from a signal, a name ("SIGTERM" or "TERM"), or a sequence of them."""
    if isinstance(value, (bytes, bytearray, dict)):  # bytes iterate as numbers: b"\x0f" read as SIGTERM
        raise ConfigError(f"{name}={shown(value)}: must be a signal, a signal name, or a tuple of them")
    items = [value] if isinstance(value, (int, str, signal.Signals)) and not isinstance(value, bool) else value
    try:
        items = list(items)
    except TypeError:
        raise ConfigError(f"{name}={shown(value)}: must be a signal, a signal name, or a tuple of them") from None
    out = []
    for item in items:
        sig = _one_signal(name, item)
        if sig in _UNCATCHABLE:
            raise ConfigError(f"{name}: {signal.Signals(sig).name} cannot be caught by any process; "
                              "pre-emption notices arrive as SIGTERM (or SIGUSR1 on some schedulers)")
        if sig in _NOT_NOTICES:
            raise ConfigError(f"{name}: {signal.Signals(sig).name} {_NOT_NOTICES[sig]}, not a pre-emption notice; "
                              "notices arrive as SIGTERM, SIGINT, SIGHUP, SIGUSR1/SIGUSR2, SIGXCPU, SIGPWR or a "
                              "real-time signal")
        out.append(sig)
    return tuple(dict.fromkeys(out))


def _signal_numbers(reason: str, *names: str) -> dict[int, str]:
    return {int(getattr(signal, n)): reason for n in names if hasattr(signal, n)}


# Signals that mean something else to the process: recording them as a notice instead of their
# effect turned a crash into a hang (SIGSEGV: the faulting instruction ran again forever) and a
# finished child process into a pre-emption (SIGCHLD).
_NOT_NOTICES = {
    **_signal_numbers("is raised by a fault in the process itself (its handler must end it)",
                      "SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL", "SIGTRAP", "SIGSYS", "SIGABRT"),
    **_signal_numbers("reports an event of the process's own (a child ended, a closed pipe, a window "
                      "size, urgent data, job control, a profiler's timer)",
                      "SIGCHLD", "SIGPIPE", "SIGWINCH", "SIGURG", "SIGCONT", "SIGTSTP", "SIGTTIN", "SIGTTOU",
                      "SIGPROF", "SIGVTALRM"),
}


def _one_signal(name: str, item: Any) -> int:
    if isinstance(item, str):
        key = item.upper() if item.upper().startswith("SIG") else "SIG" + item.upper()
        if key in signal.Signals.__members__:
            return int(signal.Signals[key])
        raise ConfigError(f"{name}: {shown(item)} is not a signal name (e.g. 'SIGTERM')")
    if isinstance(item, bool) or not isinstance(item, int):
        raise ConfigError(f"{name}: {shown(item)} is not a signal (e.g. signal.SIGTERM)")
    if int(item) not in {int(s) for s in signal.valid_signals()}:  # real-time signals have no Signals member
        raise ConfigError(f"{name}: {shown(item)} is not a signal number on this system")
    return int(item)


# Every CheckpointManager setting and a value that must be refused, for the one test over all.
SETTINGS = {
    "keep_last": 0, "keep_best": "2", "best_mode": "lowest", "async_save": "no", "timeout": True,
    "leftover_grace_s": float("nan"), "world_size_policy": "auto", "split_writes": 1,
    "allow_dtype_cast": "yes", "missing_entries": "ignore", "preemption_signals": signal.SIGKILL,
    "incremental": 1, "overlap_snapshot": "on", "signing_key": b"not a key", "verify_key": 12, "writer": "processes", "staging_bytes": 0,
}


_Call = TypeVar("_Call", bound=Callable[..., Any])


def arguments_checked(function: _Call) -> _Call:
    """A call with an argument `function` does not take raises ArgumentNameError (a ConfigError
    and a TypeError) naming it and the closest parameter, not Python's bare TypeError
    (`CheckpointManager(url, keeplast=2)`). Checked only when the call raised TypeError, by
    binding the arguments again: a TypeError from inside the function is raised as it was."""
    signature = inspect.signature(function)
    name = function.__qualname__.replace(".__init__", "")

    @functools.wraps(function)
    def checked(*args: Any, **kwargs: Any) -> Any:
        try:
            return function(*args, **kwargs)
        except TypeError as e:
            try:
                signature.bind(*args, **kwargs)
            except TypeError as bad:
                raise ArgumentNameError(_argument_advice(name, signature, kwargs, bad)) from e
            raise

    return checked  # type: ignore[return-value]


def _argument_advice(name: str, signature: inspect.Signature, kwargs: dict[str, Any], bad: TypeError) -> str:
    known = [p for p in signature.parameters if p != "self"]
    unknown = [k for k in kwargs if k not in signature.parameters]
    hints = []
    for key in unknown:
        close = difflib.get_close_matches(key, known, n=1)
        hints.append(f"{key}= (did you mean {close[0]}=?)" if close else f"{key}=")
    said = f"{name}() does not take {', '.join(hints)}" if hints else f"{name}(): {bad}"
    return f"{said}; it takes {', '.join(known) if known else 'no arguments'}"
