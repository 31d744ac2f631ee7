"""The Informer-style forecaster and its training loop."""

from attnzoo.models.informer import Informer, InformerConfig
from attnzoo.models.train import Callbacks, LastValue, TrainConfig, evaluate, time_steps, train

__all__ = ["Callbacks", "Informer", "InformerConfig", "LastValue", "TrainConfig", "evaluate", "time_steps",
           "train"]
