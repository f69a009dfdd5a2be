"""tools/te_carry.py: cutting a stream into parts, joining them, the sha256 checks and the wheel round trip."""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import json
import pathlib
import shutil
import struct
import subprocess
import zipfile

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("te_carry", ROOT / "tools" / "te_carry.py")
tc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tc)


def _random_bytes(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def _manifest_for(writer) -> dict:
    return {"parts": writer.parts, "whole_sha256": writer.whole.hexdigest(), "whole_bytes": writer.total}


@pytest.mark.parametrize("size, part, writes", [(0, 7, [0]), (1, 7, [1]), (70, 7, [70]), (71, 7, [3, 60, 8]),
                                                (1000, 64, [1, 511, 0, 488])])
def test_part_writer_cuts_and_join_restores(tmp_path, size, part, writes):
    data = _random_bytes(size, seed=size)
    w = tc.PartWriter(tmp_path, part)
    at = 0
    for n in writes:
        w.write(data[at:at + n])
        at += n
    w.close()
    assert w.total == size and w.whole.hexdigest() == hashlib.sha256(data).hexdigest()
    assert [p["index"] for p in w.parts] == list(range(1, len(w.parts) + 1))
    assert len(w.parts) == -(-size // part)  # an empty stream writes no part
    assert all(p["bytes"] == part for p in w.parts[:-1]) and all(0 < p["bytes"] <= part for p in w.parts)
    out = tmp_path / "joined"
    tc.join_parts(tmp_path, _manifest_for(w), out)
    assert out.read_bytes() == data


def test_part_writer_rejects_a_non_positive_size(tmp_path):
    with pytest.raises(ValueError, match="te_carry: part size"):
        tc.PartWriter(tmp_path, 0)


def _three_parts(tmp_path):
    data = _random_bytes(300, seed=3)
    w = tc.PartWriter(tmp_path, 100)
    w.write(data)
    w.close()
    return _manifest_for(w)


def test_join_names_every_missing_part(tmp_path):
    manifest = _three_parts(tmp_path)
    tc.part_file(tmp_path, 1).unlink()
    tc.part_file(tmp_path, 3).unlink()
    assert tc.present_parts(tmp_path, manifest) == ([2], [1, 3])
    with pytest.raises(tc.CarryError, match=r"missing part\(s\) 1, 3 of 3 \(.cache/te_part1, .cache/te_part3\)"):
        tc.join_parts(tmp_path, manifest, tmp_path / "joined")
    with pytest.raises(tc.CarryError, match="part 1 of 3 is missing"):
        tc.check_part(tmp_path, manifest, 1)
    with pytest.raises(tc.CarryError, match="part 4 does not exist"):
        tc.check_part(tmp_path, manifest, 4)


def test_join_rejects_a_damaged_part_and_a_foreign_pack(tmp_path):
    manifest = _three_parts(tmp_path)
    path = tc.part_file(tmp_path, 2)
    good = path.read_bytes()
    path.write_bytes(bytes([good[0] ^ 1]) + good[1:])  # same size, one bit off
    with pytest.raises(tc.CarryError, match="part 2 of 3 is damaged"):
        tc.join_parts(tmp_path, manifest, tmp_path / "joined")
    path.write_bytes(good)
    other = dict(manifest, whole_sha256="0" * 64)
    with pytest.raises(tc.CarryError, match="different packs"):
        tc.join_parts(tmp_path, other, tmp_path / "joined")


def _wheel(path: pathlib.Path, members: dict[str, bytes]) -> None:
    """A wheel-shaped zip with a RECORD of its members' sha256s."""
    rows = [f"{name},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},{len(data)}"
            for name, data in members.items()]
    record = "pkg-1.0.dist-info/RECORD"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(zipfile.ZipInfo("pkg/"), b"")  # a folder entry, as some wheels have
        for name, data in members.items():
            info = zipfile.ZipInfo(name)
            info.external_attr = 0o100755 << 16 if name.endswith(".so") else 0o100644 << 16
            zf.writestr(info, data)
        zf.writestr(record, "\n".join(rows + [f"{record},,"]) + "\n")


def test_pack_then_unpack_round_trip(tmp_path):
    src, parts, work = tmp_path / "src", tmp_path / "cache", tmp_path / "work"
    src.mkdir()
    members = {"pkg/__init__.py": b"x = 1\n", "pkg/lib.so": _random_bytes(50_000, seed=5) + bytes(30_000),
               "pkg/empty.txt": b"", "pkg-1.0.dist-info/METADATA": b"Name: pkg\nVersion: 1.0\n"}
    _wheel(src / "pkg-1.0-py3-none-any.whl", members)
    (src / "pkg-1.0.tar.gz").write_bytes(_random_bytes(20_000, seed=6))
    (parts / "te_part9").mkdir(parents=True)  # a stale folder from an earlier, longer pack
    manifest = tc.pack(src, parts, part_bytes=16_384, preset=1)
    assert not (parts / "te_part9").exists()
    assert len(manifest["parts"]) >= 3
    copies = [json.loads((tc.part_dir(parts, p["index"]) / tc.MANIFEST).read_text()) for p in manifest["parts"]]
    assert all(c == manifest for c in copies)
    assert tc.read_manifest(parts) == manifest
    stream = tmp_path / "joined.xz"
    tc.join_parts(parts, manifest, stream)
    files = tc.unpack(stream, work)
    assert [f.name for f in files] == ["pkg-1.0-py3-none-any.whl", "pkg-1.0.tar.gz"]
    assert files[1].read_bytes() == (src / "pkg-1.0.tar.gz").read_bytes()
    with zipfile.ZipFile(files[0]) as rebuilt, zipfile.ZipFile(src / "pkg-1.0-py3-none-any.whl") as orig:
        assert rebuilt.namelist() == orig.namelist()
        for info in orig.infolist():
            assert rebuilt.read(info.filename) == orig.read(info.filename)
            assert rebuilt.getinfo(info.filename).external_attr == info.external_attr
        assert tc.record_hashes(rebuilt) == tc.record_hashes(orig)


def test_pack_refuses_a_wheel_that_disagrees_with_its_record(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    _wheel(src / "pkg-1.0-py3-none-any.whl", {"pkg/a.py": b"a = 1\n"})
    bad = tmp_path / "bad.whl"
    with zipfile.ZipFile(src / "pkg-1.0-py3-none-any.whl") as zf, zipfile.ZipFile(bad, "w") as out:
        for info in zf.infolist():
            out.writestr(info, b"a = 2\n" if info.filename == "pkg/a.py" else zf.read(info))
    bad.replace(src / "pkg-1.0-py3-none-any.whl")
    with pytest.raises(tc.CarryError, match="does not match the wheel's RECORD"):
        tc.pack(src, tmp_path / "cache", part_bytes=1 << 20, preset=0)


def test_read_manifest_refuses_mixed_packs_and_none(tmp_path):
    with pytest.raises(tc.CarryError, match="no part folder"):
        tc.read_manifest(tmp_path)
    for i, whole in ((1, "a" * 64), (2, "b" * 64)):
        tc.part_dir(tmp_path, i).mkdir()
        (tc.part_dir(tmp_path, i) / tc.MANIFEST).write_text(json.dumps({"whole_sha256": whole, "parts": []}))
    with pytest.raises(tc.CarryError, match="different packs"):
        tc.read_manifest(tmp_path)


def test_calls_name_one_part_each_and_assemble_last():
    manifest = {"parts": [{"index": i} for i in (1, 2, 3)]}
    lines = [ln for ln in tc.calls_text(manifest).splitlines() if ln.startswith("run(")]
    assert len(lines) == 3
    for i, line in enumerate(lines, 1):
        assert f'carry=[".cache/te_part{i}"]' in line and f"check {i}" in line
    assert "assemble" in lines[-1] and "import transformer_engine.jax" in lines[-1]
    assert all("assemble" not in ln for ln in lines[:-1])


def _fatbin_container(entries: list[tuple[int, bytes]]) -> bytes:
    """A fatbinary container of ELF entries (SM number, payload), each with a 64-byte entry header."""
    body = b""
    for arch, payload in entries:
        header = bytearray(64)
        struct.pack_into("<HHIQQ", header, 0, 2, 0x101, 64, len(payload), len(payload) - 3)
        struct.pack_into("<I", header, 28, arch)
        struct.pack_into("<Q", header, 56, 10 * len(payload))  # the uncompressed size
        body += bytes(header) + payload
    return struct.pack("<IHHQ", tc.FATBIN_MAGIC, 1, 16, len(body)) + body


def _elf(sections: dict[str, bytes]) -> bytes:
    """A minimal 64-bit little-endian ELF holding ``sections`` and their name table."""
    names = b"\0" + b"".join(n.encode() + b"\0" for n in [".shstrtab", *sections])
    blobs = [names, *sections.values()]
    data, offsets = b"", []
    for blob in blobs:
        offsets.append(64 + len(data))
        data += blob + bytes(-len(blob) % 8)
    shoff = 64 + len(data)
    header = bytearray(64)
    header[:6] = b"\x7fELF\x02\x01"
    struct.pack_into("<Q", header, 0x28, shoff)
    struct.pack_into("<HHH", header, 0x3A, 64, len(blobs) + 1, 1)
    table = bytes(64)
    name_at = 1
    for (name, blob), offset in zip([(".shstrtab", names), *sections.items()], offsets):
        table += struct.pack("<IIQQQQ", name_at, 1, 0, 0, offset, len(blob)) + bytes(24)
        name_at += len(name) + 1
    return bytes(header) + data + table


def _fat_elf():
    payloads = {a: _random_bytes(n, seed=a) for a, n in ((75, 400), (90, 560), (100, 240), (120, 300))}
    payloads[100] = tc.ZSTD_MAGIC + payloads[100][4:]  # a compressed entry, as nvcc's are
    fat = (_fatbin_container([(75, payloads[75]), (90, payloads[90])]) + bytes(8)  # padding between containers
           + _fatbin_container([(100, payloads[100]), (120, payloads[120]), (90, payloads[90])]))
    return _elf({".text": _random_bytes(100, seed=1), ".nv_fatbin": fat}), fat, payloads


def _entries(fat: bytes):
    """(header, payload) of each entry of the fatbinary containers in ``fat``."""
    pos, out = 0, []
    while pos < len(fat):
        magic, _, hsize, fsize = struct.unpack_from("<IHHQ", fat, pos)
        if magic != tc.FATBIN_MAGIC:
            pos += 8
            continue
        entry = pos + hsize
        while entry < pos + hsize + fsize:
            psize = struct.unpack_from("<Q", fat, entry + 8)[0]
            out.append((fat[entry:entry + 64], fat[entry + 64:entry + 64 + psize]))
            entry += 64 + psize
        pos += hsize + fsize
    return out


def test_keep_gpu_arch_empties_only_other_architectures_code():
    elf, fat, payloads = _fat_elf()
    cut = bytearray(elf)
    assert tc.keep_gpu_arch(cut, 90) == 400 + 240 + 300
    assert len(cut) == len(elf)
    offset, size = tc.elf_section(bytes(cut), b".nv_fatbin")
    assert size == len(fat)
    changed = [i for i in range(len(elf)) if elf[i] != cut[i]]
    assert changed and all(offset <= i < offset + size for i in changed)  # nothing outside .nv_fatbin moves
    before, after = _entries(fat), _entries(bytes(cut[offset:offset + size]))
    assert len(before) == 5 and [h[28:32] for h, _ in after] == [h[28:32] for h, _ in before]
    for (old_h, old_p), (new_h, new_p) in zip(before, after):
        arch = struct.unpack_from("<I", old_h, 28)[0]
        if arch == 90:
            assert (new_h, new_p) == (old_h, old_p)
            continue
        stub = tc.empty_cubin(arch)
        compressed = old_p.startswith(tc.ZSTD_MAGIC)
        frame = tc.zstd_stored(stub) if compressed else stub
        assert new_p == frame + bytes(len(old_p) - len(frame))
        assert struct.unpack_from("<Q", new_h, 56)[0] == len(stub)
        assert struct.unpack_from("<Q", new_h, 16)[0] == (len(frame) if compressed else len(old_p) - 3)
    assert tc.keep_gpu_arch(bytearray(_elf({".text": b"abc"})), 90) == 0
    assert tc.keep_gpu_arch(bytearray(b"not an elf at all"), 90) == 0


def test_empty_cubin_is_an_elf_for_its_architecture():
    stub = tc.empty_cubin(90)
    assert tc.elf_section(stub, b".shstrtab") == (64, 11)
    assert struct.unpack_from("<H", stub, 18)[0] == 190  # EM_CUDA
    assert (struct.unpack_from("<I", stub, 48)[0] >> 8) & 0xFF == 90


def test_zstd_stored_frame_decompresses(tmp_path):
    zstd = shutil.which("zstd")
    if zstd is None:
        pytest.skip("no zstd command to decompress with")
    for data in (b"", b"x", tc.empty_cubin(100)):
        path = tmp_path / "frame.zst"
        path.write_bytes(tc.zstd_stored(data))
        out = subprocess.run([zstd, "-dc", str(path)], capture_output=True, check=True).stdout
        assert out == data


def test_keep_gpu_arch_refuses_an_unknown_layout_and_a_too_small_entry():
    bad = bytearray(_fatbin_container([(75, b"12345678")]))
    struct.pack_into("<Q", bad, 16 + 8, 1 << 20)  # the entry claims more bytes than its container holds
    with pytest.raises(tc.CarryError, match="unknown layout"):
        tc.keep_gpu_arch(bytearray(_elf({".nv_fatbin": bytes(bad)})), 90)
    small = _fatbin_container([(75, _random_bytes(100, seed=9))])
    with pytest.raises(tc.CarryError, match="no room"):
        tc.keep_gpu_arch(bytearray(_elf({".nv_fatbin": small})), 90)


def test_pack_with_gpu_arch_carries_the_cut_library(tmp_path):
    elf, _, payloads = _fat_elf()
    src = tmp_path / "src"
    src.mkdir()
    _wheel(src / "pkg-1.0-py3-none-any.whl", {"pkg/lib.so": elf, "pkg/a.py": b"a = 1\n"})
    manifest = tc.pack(src, tmp_path / "cache", part_bytes=1 << 20, preset=0, gpu_arch=90)
    assert manifest["gpu_code"].startswith("sm_90 only") and "pkg/lib.so" in manifest["gpu_code"]
    tc.join_parts(tmp_path / "cache", manifest, tmp_path / "joined")
    (wheel,) = tc.unpack(tmp_path / "joined", tmp_path / "work")
    with zipfile.ZipFile(wheel) as zf:
        lib = zf.read("pkg/lib.so")
        assert zf.read("pkg/a.py") == b"a = 1\n"
    expected = bytearray(elf)
    tc.keep_gpu_arch(expected, 90)
    assert lib == bytes(expected) and payloads[75] not in lib and payloads[90] in lib
