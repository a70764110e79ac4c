"""The ``ckptkit`` command line: thin click commands over :mod:`ckptkit.offline`.

Each command parses its arguments, calls one library function and renders
the result (:mod:`ckptkit.cli.render`), so everything the CLI shows is also
available to scripts, and the CLI never learns the on-disk format.
"""
