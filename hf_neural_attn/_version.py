"""The package version, in a module of its own: pyproject.toml reads it here without importing the package (and
torch with it), and the library's modules read it without importing the package root."""

__version__ = "0.1.0"
