"""Importers and exporters of other checkpoint formats (Megatron torch_dist and legacy,
DeepSpeed ZeRO, DCP, Hugging Face safetensors, zarr).

This is the only place where foreign pickle-based formats may be opened, and only through an
allow-list unpickler or ``torch.load(weights_only=True)``; ``ckptkit/`` itself never unpickles.
DCP (``torch.distributed.checkpoint``; torchtitan, and the base of Megatron's torch_dist) ships in
:mod:`converters.dcp`: import into ckptkit and export for plain ``dcp.load`` (docs/converters.md).
Its ``.metadata`` pickle is read only through :mod:`converters.safe_unpickle`. DeepSpeed ZeRO:
:mod:`converters.deepspeed`; Megatron torch_dist and legacy: :mod:`converters.megatron`
(docs/megatron.md); Hugging Face safetensors export: :mod:`converters.hf_safetensors`.
"""
