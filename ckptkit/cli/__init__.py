"""The ``ckptkit`` command line: thin click commands over :mod:`ckptkit.offline` and the converter registry.

* :mod:`ckptkit.cli.main` — the command group and its one error boundary (a CkptkitError is one
  ``error:`` line and exit 2, anything else exit 3 without a traceback);
* :mod:`ckptkit.cli.options` — the shared option types and options (``--json``, sizes, layouts,
  layer counts, ``--storage-option KEY=VALUE``, ``--threads``, Megatron's ``--vocab-size`` /
  ``--divisible-by``);
* :mod:`ckptkit.cli.output` — the one output sink (text, tables, JSON) and the one progress bar;
* ``commands_<name>.py`` — one command each: parse, call one public library function
  (``ckptkit.offline.*`` or :func:`ckptkit_converters.registry.convert`), render. Commands never
  import each other, and import the library only when they run.

So everything the CLI shows is also available to scripts, and the CLI never learns the on-disk format.
"""
