"""The library's version, in a leaf module: a manifest records it without importing the package.

`pyproject.toml` reads it from here (`[tool.setuptools.dynamic]`), so it is written once.
"""

__version__ = "0.1.0"
