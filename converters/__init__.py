"""Importers and exporters of other checkpoint formats (Megatron torch_dist and legacy,
DeepSpeed ZeRO, DCP, Hugging Face safetensors, zarr); installed as ``ckptkit_converters``.

:mod:`ckptkit_converters.registry` is the way in: ``detect(url)`` names a source's format and
``convert(source, dest, to_format=..., options=...)`` runs any direction, returning one result
type (``ckptkit.engine.offline_writer.ConvertResult``). Its importers are registered under the
``ckptkit.formats`` entry-point group, so ``ckptkit.reshard`` takes a foreign source directly.

This is the only place where foreign pickle-based formats may be opened, and only through
:mod:`ckptkit_converters.common.safe_unpickle`: an allow-list unpickler for DCP's ``.metadata``, and
``torch.load`` with an allow-list unpickler built for that call (torch's ``weights_only`` globals
plus exactly each format's inert stand-ins; torch's process-wide ``safe_globals`` is never used) for
``.pt`` files;
``ckptkit/`` itself never unpickles (docs/converters.md, "What is trusted"). DCP:
:mod:`ckptkit_converters.dcp.convert`; DeepSpeed ZeRO: :mod:`ckptkit_converters.deepspeed.convert`; Megatron:
:mod:`ckptkit_converters.megatron.importer` (docs/megatron.md); Hugging Face safetensors export:
:mod:`ckptkit_converters.hf.exporter`; zarr: :mod:`ckptkit_converters.zarr.convert`.
"""

from ckptkit_converters.common import old_names as _old_names

_old_names.install()
