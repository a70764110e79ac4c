"""The memory tier's digests of raw bytes (``ckptkit/memory/digest.py``): a CRC32C of every block,
folded with the length into one SHA-256; SHA-256 digests of version 1 share headers still checked.

The properties run with tiny blocks (the module reads ``BLOCK`` at every update), so random inputs
cross many block boundaries; one case runs at the real 4 MiB block size.
"""

from __future__ import annotations

import hashlib
import os
import struct

import crc32c
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptkit.errors import CorruptCheckpointError
from ckptkit.memory import digest
from ckptkit.memory.node_folder import SHARE_VERSION, NodeFolder, ShareHeader

RUN = "ab" * 16


def by_definition(data: bytes, block: int) -> str:
    """The digest written out from its definition, independently of the streaming code."""
    crcs = b"".join(struct.pack("<I", crc32c.crc32c(data[i:i + block])) for i in range(0, len(data), block))
    return digest.PREFIX + hashlib.sha256(struct.pack("<Q", len(data)) + crcs).hexdigest()


def fed(data: bytes, cuts: list[int]) -> str:
    h = digest.new()
    at = 0
    for cut in sorted(cuts) + [len(data)]:
        h.update(memoryview(data)[at:max(at, cut)])
        at = max(at, cut)
    return h.hexdigest()


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=200), cuts=st.lists(st.integers(0, 200), max_size=8), block=st.integers(1, 40))
def test_the_digest_is_its_definition_however_the_bytes_are_fed(data, cuts, block):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(digest, "BLOCK", block)
        assert fed(data, cuts) == digest.of(data) == by_definition(data, block)


@settings(max_examples=300, deadline=None)
@given(data=st.binary(min_size=1, max_size=200), block=st.integers(1, 40), data2=st.data())
def test_any_changed_byte_a_byte_more_or_less_changes_the_digest(data, block, data2):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(digest, "BLOCK", block)
        _changes_change_the_digest(data, block, data2)


def _changes_change_the_digest(data: bytes, block: int, data2: st.DataObject) -> None:
    at = data2.draw(st.integers(0, len(data) - 1))
    flip = data2.draw(st.integers(1, 255))
    changed = bytearray(data)
    changed[at] ^= flip  # a CRC catches every error confined to 32 bits: a byte always
    assert digest.of(bytes(changed)) != digest.of(data)
    assert digest.of(data + b"\0") != digest.of(data)  # zero padding is not the snapshot
    assert digest.of(data[:-1]) != digest.of(data)
    swapped = data[block:2 * block] + data[:block] + data[2 * block:]  # blocks in another order
    if swapped != data:
        assert digest.of(swapped) != digest.of(data)


def test_the_real_block_size_across_a_boundary():
    data = os.urandom(digest.BLOCK + 12345)
    assert fed(data, [1, digest.BLOCK - 1, digest.BLOCK + 7]) == by_definition(data, digest.BLOCK)
    assert digest.of(data).startswith(digest.PREFIX) and len(digest.of(data)) == len(digest.PREFIX) + 64


def test_a_bare_hex_digest_is_checked_as_sha256_of_version_1():
    h = digest.new(hashlib.sha256(b"x").hexdigest())
    h.update(b"x")
    assert h.hexdigest() == hashlib.sha256(b"x").hexdigest()


def _write_share(folder: NodeFolder, data: bytes, header: ShareHeader, version: int) -> None:
    os.makedirs(folder.step_path(3), exist_ok=True)
    with open(os.path.join(folder.step_path(3), "share-00001.bin"), "wb") as f:
        f.write(data)
    doc = header.to_json().replace(b'"version": %d' % SHARE_VERSION, b'"version": %d' % version)
    with open(os.path.join(folder.step_path(3), "share-00001.json"), "wb") as f:
        f.write(doc)


@pytest.mark.parametrize("version", [1, 2, SHARE_VERSION])
def test_a_share_is_checked_with_the_digest_its_header_names(tmp_path, version):
    folder = NodeFolder(str(tmp_path / "node"))
    data = os.urandom(64)
    share_digest = hashlib.sha256(data).hexdigest() if version == 1 else digest.of(data)
    header = ShareHeader(3, (0, 1, 2), 1, 64, (64, 64, 64), ("0" * 64,) * 3, share_digest,
                         RUN if version == SHARE_VERSION else None)
    _write_share(folder, data, header, version)
    assert folder.check_share(3, 1) == header
    damaged = bytearray(data)
    damaged[40] ^= 4
    _write_share(folder, bytes(damaged), header, version)
    with pytest.raises(CorruptCheckpointError, match="digest"):
        folder.check_share(3, 1)


def test_new_share_headers_are_version_3_with_their_run_and_others_are_refused(tmp_path):
    folder = NodeFolder(str(tmp_path / "node"))
    data = bytes(64)
    header = ShareHeader(3, (0, 1, 2), 1, 64, (64, 64, 64), ("0" * 64,) * 3, digest.of(data), RUN)
    assert b'"version": 3' in header.to_json() and RUN.encode() in header.to_json()
    _write_share(folder, data, header, 2)  # a version 2 header names no run: a run it may carry is not believed
    assert folder.share_header(3, 1).run is None
    for version in (0, 4):
        _write_share(folder, data, header, version)
        with pytest.raises(CorruptCheckpointError, match="inconsistent"):
            folder.check_share(3, 1)
    no_run = ShareHeader(3, (0, 1, 2), 1, 64, (64, 64, 64), ("0" * 64,) * 3, digest.of(data), None)
    _write_share(folder, data, no_run, 3)
    with pytest.raises(CorruptCheckpointError, match="run: expected a string"):  # version 3 must name its run
        folder.check_share(3, 1)


def test_a_share_moved_to_another_step_or_holder_is_refused(tmp_path):
    """A share's header names its step and holder: copied under another step's or rank's name (its
    bytes and digest intact), it would rebuild that step's member from another step's parity."""
    folder = NodeFolder(str(tmp_path / "node"))
    data = bytes(range(64))
    header = ShareHeader(3, (0, 1, 2), 1, 64, (64, 64, 64), ("0" * 64,) * 3, digest.of(data), RUN)
    _write_share(folder, data, header, SHARE_VERSION)
    assert folder.check_share(3, 1) == header
    for step, holder in ((4, 1), (3, 2)):
        os.makedirs(folder.step_path(step), exist_ok=True)
        for ext in (".bin", ".json"):
            with open(os.path.join(folder.step_path(3), f"share-00001{ext}"), "rb") as src, \
                    open(os.path.join(folder.step_path(step), f"share-{holder:05d}{ext}"), "wb") as dst:
                dst.write(src.read())
        with pytest.raises(CorruptCheckpointError, match="moved here"):
            folder.check_share(step, holder)
