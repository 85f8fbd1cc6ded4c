"""The errors of the model-backed toolkit: checkpoints, shared routed weights, daemon groups.

One root, ``ModelToolkitError``, so a command or a test can catch what this part of the toolkit
refuses (a bad checkpoint directory, shared-memory files that do not fit, a daemon group that did
not start) apart from bugs. Each message says what is wrong and what to run or pass.
"""

from __future__ import annotations


class ModelToolkitError(Exception):
    """The root of the model-backed toolkit's refusals."""


class CheckpointError(ModelToolkitError):
    """A checkpoint directory cannot be written or read as the toolkit's checkpoints are."""


class SharedWeightsError(ModelToolkitError):
    """A daemon's shared routed-expert files are missing, incomplete or do not fit."""


class StandInError(ModelToolkitError):
    """A GPU stand-in cannot be installed (sglang is not what it was written against)."""


class DaemonGroupError(ModelToolkitError):
    """A model-backed daemon group did not start, or a rank of it died while starting."""
