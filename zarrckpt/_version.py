"""The package version, in one place (pyproject.toml reads it; so does the manifest's "library" field)."""

__version__ = "0.1.0"
