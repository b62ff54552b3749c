"""The package version: what `layoutc --version` prints and every plan digest covers."""

__version__ = "0.1.0"
