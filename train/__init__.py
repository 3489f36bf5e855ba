"""Fault-tolerant DDP training of multi-task PDE surrogates on PDEBench-format HDF5 data."""

__version__ = "0.1.0"
