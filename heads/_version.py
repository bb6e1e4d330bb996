"""The one place headsteer's version is written (read by `heads.__version__`, the package
metadata via setuptools, and `headsteer --version`)."""

__version__ = "0.2.0"
