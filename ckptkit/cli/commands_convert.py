"""``ckptkit convert``: a checkpoint to a zarr v3 group (through tensorstore), or such a group back."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import click

from ckptkit.cli import render
from ckptkit.errors import CkptkitError


@contextmanager
def progress_bar(label: str, enabled: bool, *, data: bool = True) -> Iterator[Callable[[int, int], None] | None]:
    """A ``progress(done, total)`` callback drawing a bar (bytes when ``data``), or None off a terminal."""
    if not enabled:
        yield None
        return
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TaskProgressColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    columns = (DownloadColumn(binary_units=True), TransferSpeedColumn()) if data else (TaskProgressColumn(),)
    bar = Progress(label, BarColumn(), *columns, TimeRemainingColumn(), console=render.console(), transient=True)
    task = bar.add_task(label, total=None)
    with bar:
        yield lambda done, total: bar.update(task, completed=done, total=total)


@click.command("convert", short_help="Checkpoint <-> zarr v3 group (model-space arrays, via tensorstore).")
@click.argument("source")
@click.argument("dest")
@click.option("--format", "fmt", type=click.Choice(["zarr", "ckptkit"]), default=None,
              help="Output format. Default: zarr for a checkpoint, ckptkit for a zarr export.")
@click.option("--chunk-mib", type=click.FloatRange(min=0.001), default=8.0, show_default=True,
              help="zarr: largest inner (read) chunk.")
@click.option("--shard-mib", type=click.FloatRange(min=0.001), default=64.0, show_default=True,
              help="zarr: target size of one shard object.")
@click.option("--portable", is_flag=True,
              help="zarr: store bfloat16/float8 as float32 so zarr-python reads every array (lossless round trip).")
@click.option("--compression", type=click.Choice(["none", "zstd"]), default="none", show_default=True,
              help="zarr: codec of each inner chunk.")
@click.option("--threads", type=click.IntRange(1, 64), default=None,
              help="Shards (export, default 4) or ranks (import, default 2) written concurrently.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document instead of text.")
def convert_cmd(source: str, dest: str, fmt: str | None, chunk_mib: float, shard_mib: float, portable: bool,
                compression: str, threads: int | None, as_json: bool) -> None:
    """Convert SOURCE into DEST.

    A checkpoint becomes a zarr v3 group: every logical tensor (model space:
    global, unpadded; optimizer moments in parameter shape) is one array at
    its key path, written by tensorstore; the group's attributes carry the
    manifest, so converting the group back (--format ckptkit) gives a
    checkpoint with bit-identical tensors, values and layouts. DEST must not
    exist (or be empty). Both sides take s3:// URLs.

    \b
    Examples:
      ckptkit convert runs/exp1/step-0001000 step-1000.zarr --format zarr
      ckptkit convert step-1000.zarr runs/exp1-copy/step-0001000 --format ckptkit
      ckptkit convert s3://bucket/run1/step-0001200 s3://bucket/zarr/step-1200.zarr --portable
    """
    from ckptkit.modelspace.zarr_io import (
        ZarrExportOptions,
        ZarrImportOptions,
        export_zarr,
        import_zarr,
        is_zarr_export,
    )

    from_zarr = is_zarr_export(source)
    fmt = fmt or ("ckptkit" if from_zarr else "zarr")
    show = not as_json and sys.stdout.isatty()
    if fmt == "zarr":
        if from_zarr:
            raise CkptkitError(f"{source} is already a zarr group; --format ckptkit converts it back to a checkpoint")
        options = ZarrExportOptions(chunk_bytes=int(chunk_mib * 2**20), shard_bytes=int(shard_mib * 2**20),
                                    portable=portable, compression=compression,  # type: ignore[arg-type]
                                    threads=threads or ZarrExportOptions.threads)
        with progress_bar("exporting", show) as progress:
            result = export_zarr(source, dest, options=options, progress=progress)
    else:
        if not from_zarr:
            raise CkptkitError(
                f"{source} is not a zarr group (no zarr.json); --format ckptkit converts a zarr export back "
                "(a checkpoint converts to --format zarr)"
            )
        with progress_bar("importing", show) as progress:
            result = import_zarr(source, dest, options=ZarrImportOptions(threads=threads or ZarrImportOptions.threads), progress=progress)
    if as_json:
        render.print_json(result.to_json())
        return
    rate = result.nbytes / 2**20 / max(result.seconds, 1e-9)
    click.echo(
        f"converted {result.source} -> {result.destination} ({result.format}): {result.tensors} tensors, "
        f"{render.human_bytes(result.nbytes)} in {result.seconds:.2f}s ({rate:.0f} MiB/s)"
    )
