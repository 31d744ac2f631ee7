"""The Informer-style forecaster and its training loop."""

from attnzoo.models.informer import Informer, InformerConfig
from attnzoo.models.train import Callbacks, TrainConfig, evaluate, time_steps, train

__all__ = ["Callbacks", "Informer", "InformerConfig", "TrainConfig", "evaluate", "time_steps", "train"]
