"""gdnserve: an inference engine for hybrid Gated-DeltaNet + attention models."""

__version__ = "0.1.0"
