"""The one exception type for "this model cannot be loaded", shared by the loader and the model classes."""

from __future__ import annotations


class ModelLoadError(Exception):
    """A model source, config or weight file that cannot be used. The message names the file and the fault."""


class MissingWeightsError(ModelLoadError):
    """A checkpoint that lacks weights the model needs (a fault of the whole directory, not one file)."""
