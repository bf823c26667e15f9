"""The distribution's version, read by `pyproject.toml` (one place to bump)."""

__version__ = "0.2.0"
