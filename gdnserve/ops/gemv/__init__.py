"""Skinny GEMMs (decode: a few rows of activations against a large weight) in one Triton launch."""
from gdnserve.ops.gemv.skinny_triton import SkinnyConfig, skinny_config, skinny_linear

__all__ = ["SkinnyConfig", "skinny_config", "skinny_linear"]
