"""pyddp's version. Every rank compares it at init: mixed versions are an error."""
__version__ = "0.1.0"
