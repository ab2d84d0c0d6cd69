"""InferenceMesh: serve a causal language model split into layer-range stages over gRPC."""

__version__ = "0.1.0"
