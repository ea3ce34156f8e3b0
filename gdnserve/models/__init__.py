"""Model assembly per architecture: HF config → :class:`~gdnserve.models.config.ModelConfig` (config.py),
tokenizers with chat templates and the checkpoint marker (tokenizer.py), the embedded default model
(builtin.py), the hybrid decoder (qwen3_5.py) and the safetensors loader (loader.py)."""
