"""Running one step on the device: ``model_runner`` turns a step's work into a step plan and attention metadata
(``step_plan``, ``step_inputs``, ``step_work``, ``mixed_inputs``), replays CUDA graphs (``cuda_graphs``,
``graph_inputs``) and returns logits; ``sampler`` turns logits into tokens. Knows pools and sequences
(``cache``), not the scheduler."""
