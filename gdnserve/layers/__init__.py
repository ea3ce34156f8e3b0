"""nn-level building blocks that read the per-step plan (GDN mixer core, attention, MLP, norms)."""
