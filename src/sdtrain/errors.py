"""Errors that the user can fix: printed as one paragraph, never as a traceback wall."""


class SdtrainError(Exception):
    """A problem with the user's input (config, data, cluster): the message says what and how to fix it."""


class ConfigError(SdtrainError):
    """A config key is unknown, has the wrong type, or an impossible value."""


class DataError(SdtrainError):
    """A dataset file, column or row does not match what the model needs."""


class TrainingFailed(SdtrainError):
    """The run failed after Ray Train's retries; the message says where its last checkpoint is."""


class NonFiniteTraining(SdtrainError):
    """Too many consecutive optimizer steps had NaN/inf gradients: training has diverged."""
