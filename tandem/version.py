"""The one version source of the Tandem packages."""

__version__ = "0.1.0"
