"""Fault-tolerant DDP training of multi-task PDE surrogates on PDEBench-format HDF5 data."""

__version__ = "0.1.0"


def __getattr__(name: str):
    # ``from train import Surrogate`` without importing torch for every ``python -m train`` command.
    if name == "Surrogate":
        from train.use.surrogate import Surrogate

        return Surrogate
    raise AttributeError(f"module 'train' has no attribute {name!r}")
