"""A rank's share of the mixers under tensor parallelism of size ``tp``, decided once: each rank keeps
``1 / tp`` of the GDN key heads (H), value heads (HV) and attention query / KV heads, head sizes whole (the
layers check divisibility; ``engine/tp/tp_check.py`` before anything is built), and the GDN depthwise conv runs
over this rank's q, k and v: ``conv_dim = 2·H·K + HV·V`` channels. The mixers, the state and page pools, the
speculative buffers and the memory plan read these numbers here (no torch: the memory plan prices a model
before one exists)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class GDNShape:
    """One rank's GDN mixer: H key heads of size K, HV value heads of size V."""
    H: int
    HV: int
    K: int
    V: int

    @classmethod
    def split(cls, H: int, HV: int, K: int, V: int, tp: int = 1) -> GDNShape:
        """The model's (full) head counts -> this rank's."""
        return cls(H // tp, HV // tp, K, V)

    @classmethod
    def of(cls, g, tp: int = 1) -> GDNShape:
        """From a ``models.config.GDNConfig`` (num_k_heads, num_v_heads, head_k_dim, head_v_dim)."""
        return cls.split(g.num_k_heads, g.num_v_heads, g.head_k_dim, g.head_v_dim, tp)

    @property
    def conv_dim(self) -> int:
        """Channels of the depthwise conv (q, k and v) and of a conv state row."""
        return 2 * self.H * self.K + self.HV * self.V


def attn_heads(num_heads: int, num_kv_heads: int, tp: int = 1) -> tuple[int, int]:
    """This rank's attention (query heads, KV heads)."""
    return num_heads // tp, num_kv_heads // tp
