"""The α tuner service: replays recent traffic in the simulator for each α and pushes the
best one to the coordinator (see services/tuner/README.md)."""

from hexgen_tuner.config import TunerConfig
from hexgen_tuner.store import TunerStore, TuningRunRecord
from hexgen_tuner.tuner import AlphaTuner, Decision, decide
from hexgen_tuner.window import TrafficWindow, read_window, window_from_entries

__all__ = [
    "AlphaTuner",
    "Decision",
    "TrafficWindow",
    "TunerConfig",
    "TunerStore",
    "TuningRunRecord",
    "decide",
    "read_window",
    "window_from_entries",
]
