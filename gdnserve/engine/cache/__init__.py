"""The engine's memory of sequences: the GDN state pool and the attention page pool, a sequence's slot and pages
(``sequence``), the checkpoint index (token prefix -> saved state + KV pages), the host and disk tiers below it,
and ``kv_cache``, the one object the scheduler asks. Imports nothing from the rest of the engine but its API
types."""
