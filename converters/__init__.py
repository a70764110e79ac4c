"""Importers and exporters of other checkpoint formats (Megatron torch_dist and legacy,
DeepSpeed ZeRO, DCP, Hugging Face safetensors, zarr).

This is the only place where foreign pickle-based formats may be opened, and only through an
allow-list unpickler or ``torch.load(weights_only=True)``; ``ckptkit/`` itself never unpickles.
No converter ships yet: they arrive with the framework integrations.
"""
