"""pyscore: label scoring (SIS / MIS / setwise) and generation for decoder LMs, over a C++/CUDA extension.

`__version__` is the package's only version: the wheel's metadata reads it (pyproject.toml) and the server
reports it in GetModelInfo (server_version)."""

__version__ = "0.5.0"
