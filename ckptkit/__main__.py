"""``python -m ckptkit``: the command line, as the ``ckptkit`` script runs it; what ``torchrun -m ckptkit``
launches to spread a reshard over processes and nodes."""

from ckptkit.cli.main import main

if __name__ == "__main__":
    main()
