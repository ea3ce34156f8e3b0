"""The engine: state pool and checkpoint index, scheduler, step-plan builder, model runner, sampler,
speculative decoding and the engine loop (architecture.md, "The nouns"). Imports flow from ``ops``,
``layers`` and ``models`` into here, never back."""
