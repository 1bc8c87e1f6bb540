"""The kinds distckpt knows, in the order they are asked (KINDS before the package was one)."""

from __future__ import annotations

from distckpt.state.kinds.accelerate_loader import AcceleratePreparedLoader
from distckpt.state.kinds.base import Kind
from distckpt.state.kinds.config import Config
from distckpt.state.kinds.generator import Generator
from distckpt.state.kinds.imported import Imported
from distckpt.state.kinds.loader import Loader
from distckpt.state.kinds.module import Module
from distckpt.state.kinds.np_generator import NumpyGenerator
from distckpt.state.kinds.np_random_state import NumpyRandomState
from distckpt.state.kinds.prefetching import PrefetchingLoader
from distckpt.state.kinds.py_random import PythonRandom
from distckpt.state.kinds.sampler import Sampler
from distckpt.state.kinds.sharded_module import ShardedModule
from distckpt.state.kinds.sharded_optimizer import ShardedOptimizer
from distckpt.state.kinds.stateful import Stateful
from distckpt.state.kinds.tensor import Tensor
from distckpt.state.kinds.value import Value

# Asked in this order (the generic ones, Stateful, Tensor and Value, after every specific kind,
# however registered): `config` by its key first, random streams before anything with
# state_dict, Accelerate's prepared loader (which passes for a DataLoader) and a prefetching
# wrapper before a loader, a sharded module before a module. ShardedOptimizer and Imported match no object:
# classify gives the one to an optimizer, import-torch / import-dcp write the other.
BUILTIN: tuple[type[Kind], ...] = (Config, Generator, NumpyGenerator, NumpyRandomState, PythonRandom,
                                   AcceleratePreparedLoader, PrefetchingLoader, Loader, Sampler, ShardedModule, Module,
                                   ShardedOptimizer, Imported, Stateful, Tensor, Value)
