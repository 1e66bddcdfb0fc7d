"""The version of torchreplay, in the lowest layer so that every module may read it."""

__version__ = "0.1.0"
