"""Typed configuration: defaults in code, YAML and ``--set key=value`` on top, every key validated.

The schema is a tree of frozen pydantic models. Unknown keys and wrong types are errors that name the
key path (and the nearest valid key), so a typo never silently trains the wrong thing.

One module per section (tasks, data, model, training, dist, run, cluster, obs) on the shared base in section.py; the
whole config in root.py; reading and writing it in loading.py; a run's identity in identity.py. Import from here.
"""

from __future__ import annotations

from train.config.cluster import KubernetesConfig, SkyPilotConfig, SlurmConfig
from train.config.data import DataConfig, parse_bytes
from train.config.dist import DistConfig
from train.config.identity import run_identity, training_differences, training_view
from train.config.loading import apply_override, flatten, load_config, parse_yaml, to_yaml, validate
from train.config.model import (
    BUILT_IN_MODELS,
    LEGACY_TRANSFORMER_KEYS,
    ConvConfig,
    FNOConfig,
    ModelConfig,
    MultiphysicsConfig,
    ResNetConfig,
    TransformerConfig,
    UNetConfig,
    migrate_model_keys,
    model_keys_in_use,
)
from train.config.obs import ObsConfig, WandbConfig
from train.config.root import Config
from train.config.runs import RunConfig
from train.config.section import Section
from train.config.tasks import DEFAULT_TEMPLATES, PDE, ArraysConfig, DatasetFilesConfig, TaskConfig, WellConfig
from train.config.training import CompileConfig, TrainConfig

__all__ = [
    "BUILT_IN_MODELS",
    "DEFAULT_TEMPLATES",
    "LEGACY_TRANSFORMER_KEYS",
    "PDE",
    "ArraysConfig",
    "CompileConfig",
    "Config",
    "ConvConfig",
    "DataConfig",
    "DatasetFilesConfig",
    "DistConfig",
    "FNOConfig",
    "KubernetesConfig",
    "ModelConfig",
    "MultiphysicsConfig",
    "ObsConfig",
    "ResNetConfig",
    "RunConfig",
    "Section",
    "SkyPilotConfig",
    "SlurmConfig",
    "TaskConfig",
    "TrainConfig",
    "TransformerConfig",
    "UNetConfig",
    "WandbConfig",
    "WellConfig",
    "apply_override",
    "flatten",
    "load_config",
    "migrate_model_keys",
    "model_keys_in_use",
    "parse_bytes",
    "parse_yaml",
    "run_identity",
    "to_yaml",
    "training_differences",
    "training_view",
    "validate",
]
