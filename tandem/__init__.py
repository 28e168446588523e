"""Tandem's shared runtime: config, logging, gRPC server bootstrap, chain hashing, tokenizers."""

from tandem.version import __version__

__all__ = ["__version__"]
