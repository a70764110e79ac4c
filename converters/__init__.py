"""Importers and exporters of other checkpoint formats, one package per format; installed as
``ckptkit_converters``.

* :mod:`ckptkit_converters.registry` is the way in: ``formats()``, ``detect(url)``,
  ``convert(source, dest, to_format=..., source_options=..., target_options=..., run=...)``;
* each format is a package with the same parts (``format.py``: the ``Format`` object registered
  under the ``ckptkit.formats`` entry points; ``options.py``; its files, names, importer and
  exporter): :mod:`~ckptkit_converters.megatron`, :mod:`~ckptkit_converters.deepspeed`,
  :mod:`~ckptkit_converters.dcp`, :mod:`~ckptkit_converters.hf`, :mod:`~ckptkit_converters.zarr`;
* :mod:`ckptkit_converters.common` holds what they share, among it the only way a foreign pickle is
  opened: :mod:`ckptkit_converters.common.safe_unpickle` (an allow-list unpickler for DCP's
  ``.metadata``, and ``torch.load`` with an allow-list unpickler built for that call for ``.pt``
  files; torch's process-wide ``safe_globals`` is never used). ``ckptkit/`` itself never unpickles
  (docs/converters.md, "What is trusted").

docs/architecture.md, "The converters' house", says how to add a format.
"""

from ckptkit_converters.common import old_names as _old_names

_old_names.install()
