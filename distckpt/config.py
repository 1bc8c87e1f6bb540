"""The manager's settings: a small frozen object validated at construction."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ConfigError


@dataclass(frozen=True)
class ManagerConfig:
    keep_last: int | None = None
    keep_best: int | None = None
    best_mode: str = "min"
    async_save: bool = False
    timeout: float = 600.0
    leftover_grace_s: float = 3600.0
    world_size_policy: str = "refuse"

    def __post_init__(self) -> None:
        for name in ("keep_last", "keep_best"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(f"{name}={value!r}: must be a positive int or None (keep all)")
        if self.best_mode not in ("min", "max"):
            raise ConfigError(f"best_mode={self.best_mode!r}: must be 'min' or 'max'")
        if not isinstance(self.timeout, (int, float)) or not self.timeout > 0:
            raise ConfigError(f"timeout={self.timeout!r}: must be a positive number of seconds")
        if self.world_size_policy not in ("refuse", "reshard", "replicated_only"):
            raise ConfigError(f"world_size_policy={self.world_size_policy!r}: must be 'refuse' (default) or "
                              "'reshard' (restore replicated and sharded state at another world size, keep "
                              "this run's per-rank state; 'replicated_only' is its older name)")
        if not isinstance(self.leftover_grace_s, (int, float)) or self.leftover_grace_s < 0:
            raise ConfigError(f"leftover_grace_s={self.leftover_grace_s!r}: must be >= 0 seconds")
