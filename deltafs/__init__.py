"""deltafs: lossless checkpoint deltas on any fsspec filesystem."""

__version__ = "0.1.0"
