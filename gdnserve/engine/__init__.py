"""The engine (architecture.md, "The nouns"). Here, its public face and the loop: ``llm_engine`` (LLMEngine),
``async_engine``, ``engine_api`` (the public types), ``config`` (EngineConfig), ``sampling_params``, and the
loop's output side (``output_processor``, ``detokenizer``). The parts the loop drives: ``scheduling/`` (what
runs in a step), ``cache/`` (pools, sequences, checkpoints and their tiers), ``execution/`` (running a step on
the device), ``memory/`` (sizing the pools), ``tp/`` (tensor parallelism). Imports flow from ``ops``,
``layers`` and ``models`` into here, never back."""
