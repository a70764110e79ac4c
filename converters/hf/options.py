"""What an HF export and import take: two small frozen dataclasses (no torch imported).

Each carries everything the CLI passes today, so a format object can run either direction from
its options alone: the model's ``config.json`` (or, for an export, just the attention head
counts), the key table by name, and where the model sits in the checkpoint's state. Both spell
that last one the same way, ``prefix``: None asks the conversion to decide (the export detects
it, the import writes ``model/``), ``""`` is the top level, ``"x/"`` a state key.

Every value is checked when the options are made, before anything is read.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckptkit.errors import CkptkitError, OptionsError
from ckptkit_converters.hf.families import FAMILIES, MEGATRON, TORCHTITAN

if TYPE_CHECKING:
    from ckptkit_converters.hf.mapping import HFConfig

CAST_DTYPES = ("float32", "bfloat16", "float16")
"""The dtypes an export may cast to (``HFExportOptions.dtype``)."""

MODEL_PREFIX = "model/"
"""Where ckptkit's adapters (the manager, torchtitan, Megatron imports) keep the model: the import's default."""

CONFIG_LIMIT = 16 << 20  # a config.json is a few KiB; anything near this is not one


def _check_common(family: str | None, prefix: str | None) -> None:
    """The two options both directions share: a known table, and a prefix that is a state key."""
    if family is not None and family not in FAMILIES:
        raise OptionsError(f"unknown model family {family!r} (known: {', '.join(FAMILIES)})")
    if prefix not in (None, "") and not prefix.endswith("/"):
        raise OptionsError(f"prefix must end with '/' (a state key such as 'model/'), or be '', got {prefix!r}")


def hf_config_of(config: str | os.PathLike[str] | None, heads: int | None = None,
                 kv_heads: int | None = None) -> HFConfig:
    """The facts an HF export needs: from ``config`` (a ``config.json`` path), with ``heads`` /
    ``kv_heads`` overriding its head counts; without a config, the head counts alone (the Llama
    table). Neither: the error the CLI gives, naming both ways to say it."""
    from ckptkit_converters.hf.mapping import HFConfig

    if config is None and heads is None:
        raise CkptkitError("the hf export needs the model's Hugging Face config.json (its model_type picks the key "
                           "table; head counts, vocabulary and expert counts come from it) or at least the "
                           "attention head counts: hf_config or heads (CLI: --hf-config config.json, or "
                           "--heads N [--kv-heads M])")
    cfg = HFConfig.from_file(config) if config is not None else HFConfig(source="the head counts given")
    if heads is not None:
        cfg = dataclasses.replace(cfg, n_heads=heads, n_kv_heads=kv_heads or heads)
    return cfg


@dataclass(frozen=True)
class HFExportOptions:
    """How :func:`~ckptkit_converters.hf.exporter.export_hf` runs.

    ``config``: path of the model's HF ``config.json`` (its ``model_type`` picks the table; head,
    vocabulary, layer and expert counts come from it); ``heads`` / ``kv_heads``: the attention
    head counts, enough for a Llama without a config (and overriding the config's). ``family``: a
    key table by name (:data:`~ckptkit_converters.hf.families.FAMILIES`); None picks it from the
    config's ``model_type`` and the checkpoint's naming (no ``model_type``: Llama). ``prefix``:
    where the model's parameters sit in the checkpoint's state (``"model/"``, ``""`` for the top
    level); None detects it. ``dtype``: cast on export (None keeps each tensor's).
    ``tie_word_embeddings``: drop the output projection (HF re-ties it to the embedding); None:
    the config's ``tie_word_embeddings`` (absent: not tied). ``permute_rotary``: apply the table's
    rotary permutation (None: yes; False for a model whose RoPE already rotates halves).
    ``max_memory``: bytes of tensor data the export holds at once; each HF tensor is then written in
    slabs of rows (:mod:`~ckptkit_converters.hf.slabs`), the same bytes. None: whole tensors, one read
    ahead (about twice the largest HF tensor and its source slice).
    """

    family: str | None = None
    prefix: str | None = None
    dtype: str | None = None
    max_shard_bytes: int = 5 * 10**9
    tie_word_embeddings: bool | None = None
    permute_rotary: bool | None = None
    config: str | None = None
    heads: int | None = None
    kv_heads: int | None = None
    max_memory: int | None = None

    def __post_init__(self) -> None:
        _check_common(self.family, self.prefix)
        if self.max_memory is not None and (isinstance(self.max_memory, bool) or not isinstance(self.max_memory, int)
                                            or self.max_memory < 1):
            raise OptionsError(f"max_memory must be a positive number of bytes or None, got {self.max_memory!r}")
        if self.dtype is not None and self.dtype not in CAST_DTYPES:
            raise OptionsError(f"dtype must be one of {', '.join(CAST_DTYPES)} or None, got {self.dtype!r}")
        if self.max_shard_bytes < 1:
            raise OptionsError("max_shard_bytes must be positive")
        for name in ("heads", "kv_heads"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise OptionsError(f"{name} must be a positive integer, got {value!r}")

    @property
    def gives_config(self) -> bool:
        """Whether these options say what the model is (a config file or head counts)."""
        return self.config is not None or self.heads is not None

    def hf_config(self) -> HFConfig:
        """The model's facts these options give (:func:`hf_config_of`); neither a config nor heads is an error."""
        return hf_config_of(self.config, self.heads, self.kv_heads)


@dataclass(frozen=True)
class HFImportOptions:
    """How an HF folder is imported (:func:`~ckptkit_converters.hf.importer.import_hf`).

    ``config``: path of the model's HF ``config.json``; None: ``SOURCE/config.json`` if the
    folder has one (read through the same store as the weights, so ``s3://`` and hub snapshots
    work), else an error asking for it. ``family``: a key table by name; None picks it from the
    config's ``model_type``. ``prefix``: where the model's tensors go in the checkpoint's state;
    None: ``"model/"``, where ckptkit's adapters keep the model (``""``: the top level).
    ``naming``, ``permute_rotary``, ``make_vocab_size_divisible_by`` (the padding multiple a later
    Megatron export pads the vocabulary to): as :func:`import_hf` takes them.
    """

    config: str | None = None
    family: str | None = None
    prefix: str | None = None
    naming: str = TORCHTITAN
    permute_rotary: bool = True
    make_vocab_size_divisible_by: int = 128

    def __post_init__(self) -> None:
        _check_common(self.family, self.prefix)
        if self.naming not in (TORCHTITAN, MEGATRON):
            raise OptionsError(f"naming must be {TORCHTITAN!r} or {MEGATRON!r}, got {self.naming!r}")
        multiple = self.make_vocab_size_divisible_by
        if isinstance(multiple, bool) or not isinstance(multiple, int) or multiple < 1:
            raise OptionsError(f"make_vocab_size_divisible_by must be a positive integer, got {multiple!r}")

    def hf_config(self, source: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> HFConfig:
        """The model's facts: ``config`` if given, else the source folder's own ``config.json``."""
        from ckptkit_converters.hf.mapping import HFConfig

        if self.config is not None:
            return HFConfig.from_file(self.config)
        return folder_config(source, storage_options)


def folder_config(source: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> HFConfig:
    """The ``config.json`` an HF folder holds (local, ``s3://`` or a hub snapshot), parsed strictly and
    checked; a folder without one is the error the CLI gives for a missing ``--hf-config``."""
    from ckptkit.layout.strict_json import load_json
    from ckptkit_converters.hf.files import CONFIG_NAME, open_source
    from ckptkit_converters.hf.mapping import HFConfig

    store = open_source(source, storage_options)
    where = f"{store.url}/{CONFIG_NAME}"
    if not store.exists(CONFIG_NAME):
        raise CkptkitError(f"--from hf needs the model's config.json (--hf-config): its model_type picks the key "
                           f"table, and {store.url} holds none")
    try:
        doc = load_json(store.read_bytes(CONFIG_NAME, limit=CONFIG_LIMIT), where)
    except CkptkitError as exc:
        raise CkptkitError(f"{where}: not a readable JSON config ({' '.join(str(exc).split())})") from None
    if not isinstance(doc, dict):
        raise CkptkitError(f"{where}: not a JSON object")
    return HFConfig.from_dict(doc, where)
