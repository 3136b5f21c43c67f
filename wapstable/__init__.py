"""wapstable: a WAP trainer that does not silently die of NaN."""

__version__ = "0.1.0"
