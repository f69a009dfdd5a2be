"""Carries TransformerEngine-JAX 2.20.2 to the GPU machine in parts and builds it there (issues 41 and 43).

The GPU machine has no network and takes at most 64 MiB of carried files a call, while TE's core wheel
(``transformer_engine_cu13``) alone is about 276 MB. So the downloads in ``.cache/te/`` travel as one xz
stream cut into parts of at most ``--part-mib`` MiB, one part folder (``.cache/te_partN/``) a call; the folders
stay on the warm machine between calls, and the last call joins them, checks every sha256 and installs.

* ``pack`` (here): every wheel in ``.cache/te/`` is stored as its members (so xz sees the raw
  ``libtransformer_engine.so`` rather than its deflated bytes), other files as they are; the tar of them is
  compressed with xz and cut into ``.cache/te_part1/`` ... each with the same manifest ``te_carry.json``
  (sha256 of the whole stream, of each part, of each file and wheel member).
* ``check N`` (there, each part's call): checks part N's sha256 and lists the parts present so far.
* ``assemble`` (there, the last call): names any missing or damaged part, joins the parts, checks the
  sha256s, rebuilds the wheels (every member checked against the manifest), ``pip install --no-index
  --no-deps --target`` them, builds the ``transformer_engine_jax`` sdist against the machine's jax, nvcc and
  the CUDA headers of its toolkit and ``nvidia-*`` wheels, installs it beside them and prints the environment.
* ``smoke`` (there, after assemble, with ``PYTHONPATH=/tmp/te_site``): one TE LayerNormMLP step per FP8
  recipe on the GPU, which runs TE's kernels (the import alone does not).
* ``calls``: prints the sequence of device ``run`` calls for the current pack.

``pack --gpu-arch 90`` keeps only the sm_90 entries of the shared libraries' fatbinaries (``keep_gpu_arch``):
about 34 MiB in one part instead of 260.5 MiB in five, but the library is no longer PyPI's file and has not
been run on a GPU.

Nothing here writes outside ``.cache/`` and the work and target folders given (``/tmp/te_carry``,
``/tmp/te_site`` by default); tracked files are never touched.
"""

from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import io
import json
import lzma
import os
import pathlib
import re
import shlex
import shutil
import struct
import subprocess
import sys
import tarfile
import time
import zipfile
from typing import BinaryIO, Iterable

ROOT = pathlib.Path(__file__).resolve().parent.parent
TE_VERSION = "2.20.2"
SRC = ROOT / ".cache" / "te"
PARTS_ROOT = ROOT / ".cache"
MANIFEST = "te_carry.json"
FORMAT = 1
# Here, in .cache/te/, before pack: the three TE distributions; the rest of .cache/te/ travels as well.
REQUIRED = (f"transformer_engine-{TE_VERSION}-py3-none-any.whl",
            f"transformer_engine_cu13-{TE_VERSION}-*.whl",
            f"transformer_engine_jax-{TE_VERSION}.tar.gz")
# 64 MiB a call holds the part, the working tree (about 3 MiB) and the tool itself.
DEFAULT_PART_MIB = 56
STORED_MEMBER_BYTES = 16 << 20  # rebuilt wheels store members this large instead of deflating them
# Headers the transformer_engine_jax extension includes (csrc/extensions.h and common/util/logging.h).
BUILD_HEADERS = ("cuda_runtime.h", "cuda.h", "cudaTypedefs.h", "cuda_fp8.h", "cublas_v2.h", "cublasLt.h",
                 "nvrtc.h", "cudnn.h", "cudnn_graph.h", "nccl.h")


class CarryError(RuntimeError):
    """A part or file that is missing or does not match the manifest."""


def part_dir(root: pathlib.Path, index: int) -> pathlib.Path:
    """The folder of part ``index`` (1-based): the one path a part's call names in ``carry``."""
    return root / f"te_part{index}"


def part_file(root: pathlib.Path, index: int) -> pathlib.Path:
    """Part ``index``'s bytes, inside its folder."""
    return part_dir(root, index) / f"payload.part{index}"


def sha256_file(path: pathlib.Path) -> str:
    """The hex sha256 of a file, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class PartWriter(io.RawIOBase):
    """A write-only stream that cuts what it is given into part files of at most ``part_bytes`` bytes.

    It keeps the sha256 of the whole stream and of each part; ``close`` ends the last part.
    """

    def __init__(self, root: pathlib.Path, part_bytes: int):
        if part_bytes <= 0:
            raise ValueError(f"te_carry: part size must be positive, got {part_bytes}")
        self.root, self.part_bytes = root, part_bytes
        self.whole = hashlib.sha256()
        self.total = 0
        self.parts: list[dict] = []
        self._file: BinaryIO | None = None
        self._hash = hashlib.sha256()
        self._size = 0

    def writable(self) -> bool:
        return True

    def _end_part(self) -> None:
        if self._file is not None:
            self._file.close()
            index = len(self.parts) + 1
            self.parts.append({"index": index, "bytes": self._size, "sha256": self._hash.hexdigest()})
            self._file = None

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            if self._file is None:
                index = len(self.parts) + 1
                part_dir(self.root, index).mkdir(parents=True, exist_ok=True)
                self._file = part_file(self.root, index).open("wb")
                self._hash, self._size = hashlib.sha256(), 0
            chunk = view[done:done + self.part_bytes - self._size]
            self._file.write(chunk)
            self._hash.update(chunk)
            self.whole.update(chunk)
            self._size += len(chunk)
            self.total += len(chunk)
            done += len(chunk)
            if self._size == self.part_bytes:
                self._end_part()
        return len(view)

    def close(self) -> None:
        if not self.closed:
            self._end_part()
        super().close()


def present_parts(root: pathlib.Path, manifest: dict) -> tuple[list[int], list[int]]:
    """(present, missing) part numbers: a part is present when its file is there with the manifest's size."""
    present, missing = [], []
    for part in manifest["parts"]:
        path = part_file(root, part["index"])
        ok = path.is_file() and path.stat().st_size == part["bytes"]
        (present if ok else missing).append(part["index"])
    return present, missing


def check_part(root: pathlib.Path, manifest: dict, index: int) -> None:
    """Raises CarryError unless part ``index`` is there with the manifest's sha256."""
    count = len(manifest["parts"])
    if not 1 <= index <= count:
        raise CarryError(f"te_carry: part {index} does not exist: this pack has parts 1..{count}")
    part = manifest["parts"][index - 1]
    path = part_file(root, index)
    if not path.is_file():
        raise CarryError(f"te_carry: part {index} of {count} is missing: {path} not found on this machine; "
                         f"make the call that carries {part_dir(pathlib.Path('.cache'), index)} again")
    digest = sha256_file(path)
    if digest != part["sha256"]:
        raise CarryError(f"te_carry: part {index} of {count} is damaged: sha256 {digest} of {path}, manifest "
                         f"{part['sha256']}; pack again here or carry {part_dir(pathlib.Path('.cache'), index)} again")


def join_parts(root: pathlib.Path, manifest: dict, dest: pathlib.Path) -> None:
    """Joins the parts into ``dest``, after naming every missing part, then checks each part and the whole."""
    _, missing = present_parts(root, manifest)
    if missing:
        count = len(manifest["parts"])
        folders = ", ".join(str(part_dir(pathlib.Path(".cache"), i)) for i in missing)
        raise CarryError(f"te_carry: missing part(s) {', '.join(map(str, missing))} of {count} ({folders}). Each "
                         "part's call leaves its folder on the machine only while it stays warm (30 s after a call): "
                         "make the missing parts' calls again, back to back, then assemble")
    whole = hashlib.sha256()
    with dest.open("wb") as out:
        for part in manifest["parts"]:
            check_part(root, manifest, part["index"])
            with part_file(root, part["index"]).open("rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    whole.update(block)
                    out.write(block)
    if whole.hexdigest() != manifest["whole_sha256"]:
        raise CarryError(f"te_carry: the joined stream's sha256 {whole.hexdigest()} is not the manifest's "
                         f"{manifest['whole_sha256']}: the parts come from different packs; pack again and carry all")


def read_manifest(root: pathlib.Path) -> dict:
    """The manifest found in the part folders present; all copies must agree."""
    copies = sorted(root.glob(f"te_part*/{MANIFEST}"))
    if not copies:
        raise CarryError(f"te_carry: no part folder with {MANIFEST} under {root}: carry .cache/te_part1 ... first "
                         "(`python3 tools/te_carry.py calls` here prints the calls)")
    manifests = {p: json.loads(p.read_text()) for p in copies}
    wholes = {m["whole_sha256"] for m in manifests.values()}
    if len(wholes) != 1:
        listing = "; ".join(f"{p.parent.name}: {m['whole_sha256'][:12]}" for p, m in manifests.items())
        raise CarryError(f"te_carry: the part folders come from different packs ({listing}); "
                         "carry all parts of one pack")
    return next(iter(manifests.values()))


def record_hashes(zf: zipfile.ZipFile) -> dict[str, str]:
    """A wheel's RECORD as {member: hex sha256} (members listed without a hash are left out)."""
    name = next((n for n in zf.namelist() if n.endswith(".dist-info/RECORD")), None)
    if name is None:
        raise CarryError(f"te_carry: {zf.filename} has no .dist-info/RECORD")
    out = {}
    for row in csv.reader(io.StringIO(zf.read(name).decode())):
        if len(row) >= 2 and row[1].startswith("sha256="):
            digest = base64.urlsafe_b64decode(row[1][len("sha256="):] + "==")
            out[row[0]] = digest.hex()
    return out


FATBIN_MAGIC = 0xBA55ED50


def elf_section(elf: bytes, name: bytes) -> tuple[int, int] | None:
    """(file offset, size) of the 64-bit little-endian ELF's section ``name``, or None."""
    if elf[:6] != b"\x7fELF\x02\x01":
        return None
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
    header = lambda i: struct.unpack_from("<IIQQQQ", elf, shoff + i * shentsize)  # noqa: E731
    strtab = header(shstrndx)[4]
    for i in range(shnum):
        sh_name, _, _, _, offset, size = header(i)
        if elf[strtab + sh_name:strtab + sh_name + len(name) + 1] == name + b"\0":
            return offset, size
    return None


ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


def empty_cubin(arch: int) -> bytes:
    """A CUDA ELF for ``sm_<arch>`` with no code: nvcc's header, a null section and the section-name table."""
    names = b"\0.shstrtab\0".ljust(16, b"\0")
    header = bytearray(64)
    header[:9] = b"\x7fELF\x02\x01\x01\x41\x08"
    struct.pack_into("<HHIQQQ", header, 16, 2, 190, 1, 0, 0, 64 + len(names))  # executable, EM_CUDA, e_shoff
    struct.pack_into("<IHHHHHH", header, 48, 0x06000004 | (arch << 8), 64, 0x38, 0, 64, 2, 1)
    null = bytes(64)
    strtab = struct.pack("<IIQQQQIIQQ", 1, 3, 0, 0, 64, 11, 0, 0, 1, 0)  # .shstrtab: SHT_STRTAB at 64, 11 bytes
    return bytes(header) + names + null + strtab


def zstd_stored(data: bytes) -> bytes:
    """A zstd frame holding ``data`` in one raw block (``data`` under 128 KiB)."""
    return (ZSTD_MAGIC + bytes([0xE0]) + struct.pack("<Q", len(data))  # single segment, 8-byte content size
            + struct.pack("<I", 1 | (len(data) << 3))[:3] + data)


def keep_gpu_arch(elf: bytearray, arch: int) -> int:
    """Empties, in place, every entry of the ELF's ``.nv_fatbin`` not built for ``sm_<arch>``.

    Each fatbinary entry has a header (kind, header size, padded payload size at byte 8, compressed size at
    16, the SM number at 28, the uncompressed size at 56) and a payload (here a zstd frame). A cut entry's
    payload becomes a zstd frame of as many zero bytes as before, its compressed size that frame's, the rest
    of its padded payload zeros: offsets and sizes stay, so nothing else in the library moves, tools that
    decompress every entry still can, and the CUDA driver, which picks the entry matching the GPU by its
    header, finds the sm_<arch> ones intact (not run on a GPU here). Returns the payload bytes emptied;
    0 without a ``.nv_fatbin``.
    """
    section = elf_section(elf, b".nv_fatbin")
    if section is None:
        return 0
    pos, end = section[0], section[0] + section[1]
    emptied = 0
    while pos + 16 <= end:
        magic, _, hsize, fsize = struct.unpack_from("<IHHQ", elf, pos)
        if magic != FATBIN_MAGIC:  # padding between the containers
            pos += 8
            continue
        entry, stop = pos + hsize, pos + hsize + fsize
        if stop > end:
            raise CarryError(f"te_carry: fatbinary container at {pos:#x} runs past .nv_fatbin: unknown layout")
        while entry < stop:
            _, _, ehsize, psize = struct.unpack_from("<HHIQ", elf, entry)
            if ehsize < 64 or entry + ehsize + psize > stop:
                raise CarryError(f"te_carry: fatbinary entry at {entry:#x} has an unknown layout")
            body = entry + ehsize
            entry_arch = struct.unpack_from("<I", elf, entry + 28)[0]
            if entry_arch != arch:
                stub = empty_cubin(entry_arch)
                frame = zstd_stored(stub) if elf[body:body + 4] == ZSTD_MAGIC else stub
                if len(frame) > psize:
                    raise CarryError(f"te_carry: fatbinary entry at {entry:#x}: no room for an empty cubin")
                if frame is not stub:
                    struct.pack_into("<Q", elf, entry + 16, len(frame))
                struct.pack_into("<Q", elf, entry + 56, len(stub))
                elf[body:body + psize] = frame + bytes(psize - len(frame))
                emptied += psize
            entry += ehsize + psize
        pos = stop
    return emptied


def member_bytes(zf: zipfile.ZipFile, name: str, gpu_arch: int | None) -> bytes:
    """A wheel member's bytes; a shared library's GPU code cut to ``sm_<gpu_arch>`` when one is given."""
    data = zf.read(name)
    if gpu_arch is None or not name.endswith(".so"):
        return data
    elf = bytearray(data)
    return bytes(elf) if keep_gpu_arch(elf, gpu_arch) else data


def _tar_add(tar: tarfile.TarFile, name: str, data_or_file, size: int) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = size, 0o644, 0
    tar.addfile(info, data_or_file)


class _XZWriter(io.RawIOBase):
    """A write-only stream that xz-compresses into another stream (which it does not close)."""

    def __init__(self, out: BinaryIO, preset: int):
        self.out, self.comp = out, lzma.LZMACompressor(format=lzma.FORMAT_XZ, preset=preset)

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        self.out.write(self.comp.compress(data))
        return len(memoryview(data))

    def close(self) -> None:
        if not self.closed:
            self.out.write(self.comp.flush())
        super().close()


def pack(src: pathlib.Path, root: pathlib.Path, part_bytes: int, preset: int, gpu_arch: int | None = None) -> dict:
    """Packs every file of ``src`` into part folders under ``root`` and returns the manifest written to each.

    With ``gpu_arch`` (90: H100/H200), the wheels' shared libraries keep GPU code for that SM only
    (``keep_gpu_arch``); their sha256 in the manifest is then the cut library's, ``pypi_sha256`` the original's.
    """
    files = sorted(p for p in src.iterdir() if p.is_file())
    if not files:
        raise CarryError(f"te_carry: nothing to pack in {src}")
    for old in root.glob("te_part*"):
        if old.is_dir() and re.fullmatch(r"te_part\d+", old.name):
            shutil.rmtree(old)
    index = []
    for path in files:
        entry = {"name": path.name, "bytes": path.stat().st_size, "sha256": sha256_file(path)}
        if path.suffix == ".whl":
            with zipfile.ZipFile(path) as zf:
                record = record_hashes(zf)
                members = []
                for info in zf.infolist():
                    digest = hashlib.sha256(zf.read(info)).hexdigest()
                    if info.filename in record and record[info.filename] != digest:
                        raise CarryError(f"te_carry: {path.name}: {info.filename} does not match the wheel's "
                                         "RECORD: the download is damaged; download it again")
                    member = {"name": info.filename, "bytes": info.file_size, "sha256": digest,
                              "attr": info.external_attr}
                    cut = hashlib.sha256(member_bytes(zf, info.filename, gpu_arch)).hexdigest()
                    if cut != digest:
                        member.update(sha256=cut, pypi_sha256=digest)
                    members.append(member)
            entry["members"] = members
        index.append(entry)
    writer = PartWriter(root, part_bytes)
    with _XZWriter(writer, preset) as xz:
        with tarfile.open(fileobj=xz, mode="w|", format=tarfile.PAX_FORMAT) as tar:
            blob = json.dumps(index).encode()
            _tar_add(tar, "index.json", io.BytesIO(blob), len(blob))
            for entry, path in zip(index, files):
                if "members" not in entry:
                    with path.open("rb") as f:
                        _tar_add(tar, f"f/{entry['name']}", f, entry["bytes"])
                    continue
                with zipfile.ZipFile(path) as zf:
                    for member in entry["members"]:
                        name = f"w/{entry['name']}/{member['name']}"
                        if member["name"].endswith("/"):  # a folder entry, rebuilt from the index
                            continue
                        if "pypi_sha256" in member:
                            _tar_add(tar, name, io.BytesIO(member_bytes(zf, member["name"], gpu_arch)), member["bytes"])
                            continue
                        with zf.open(member["name"]) as f:
                            _tar_add(tar, name, f, member["bytes"])
    writer.close()
    cut = [f"{e['name']}:{m['name']}" for e in index for m in e.get("members", ()) if "pypi_sha256" in m]
    manifest = {"format": FORMAT, "te_version": TE_VERSION, "compression": f"xz preset {preset}",
                "gpu_code": f"sm_{gpu_arch} only, in {cut}" if cut else "as published",
                "whole_bytes": writer.total, "whole_sha256": writer.whole.hexdigest(), "parts": writer.parts,
                "files": [{k: e[k] for k in ("name", "bytes", "sha256")} for e in index]}
    for part in writer.parts:
        (part_dir(root, part["index"]) / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest




def unpack(stream: pathlib.Path, work: pathlib.Path) -> list[pathlib.Path]:
    """Unpacks the joined stream into ``work``: each file checked against the index, each wheel rebuilt.

    Returns the rebuilt or copied files, in the index's order.
    """
    if work.exists():
        shutil.rmtree(work)
    raw, out = work / "raw", work / "files"
    out.mkdir(parents=True)
    with lzma.open(stream) as xz, tarfile.open(fileobj=xz, mode="r|") as tar:
        index = None
        for info in tar:
            if not info.isfile() or info.name.startswith("/") or ".." in pathlib.PurePosixPath(info.name).parts:
                raise CarryError(f"te_carry: unexpected entry {info.name!r} in the stream")
            f = tar.extractfile(info)
            if info.name == "index.json":
                index = json.loads(f.read())
                folders = {f"w/{e['name']}/{m['name']}" for e in index for m in e.get("members", ())
                           if m["name"].endswith("/")}
                continue
            if index is None:
                raise CarryError("te_carry: the stream does not start with index.json")
            if info.name in folders or f"{info.name}/" in folders:  # rebuild_wheel writes folder entries
                continue
            dest = raw / info.name
            dest.parent.mkdir(parents=True, exist_ok=True)
            with dest.open("wb") as g:
                shutil.copyfileobj(f, g, 1 << 20)
    if index is None:
        raise CarryError("te_carry: the stream has no index.json")
    results = []
    for entry in index:
        target = out / entry["name"]
        if "members" not in entry:
            src = raw / "f" / entry["name"]
            if not src.is_file() or sha256_file(src) != entry["sha256"]:
                raise CarryError(f"te_carry: {entry['name']} is missing or damaged after unpacking")
            src.replace(target)
        else:
            rebuild_wheel(raw / "w" / entry["name"], entry["members"], target)
        results.append(target)
    shutil.rmtree(raw)
    return results


def rebuild_wheel(members_dir: pathlib.Path, members: Iterable[dict], target: pathlib.Path) -> None:
    """Zips ``members`` (in order) from ``members_dir`` into ``target``, checking each one's sha256."""
    with zipfile.ZipFile(target, "w") as zf:
        for member in members:
            if member["name"].endswith("/"):
                info = zipfile.ZipInfo(member["name"], date_time=(2026, 1, 1, 0, 0, 0))
                info.external_attr = member["attr"]
                zf.writestr(info, b"")
                continue
            src = members_dir / member["name"]
            if not src.is_file() or sha256_file(src) != member["sha256"]:
                raise CarryError(f"te_carry: {target.name}: member {member['name']} is missing or damaged")
            info = zipfile.ZipInfo(member["name"], date_time=(2026, 1, 1, 0, 0, 0))
            info.external_attr = member["attr"]
            info.compress_type = (zipfile.ZIP_STORED if member["bytes"] >= STORED_MEMBER_BYTES
                                  else zipfile.ZIP_DEFLATED)
            with src.open("rb") as f, zf.open(info, "w", force_zip64=member["bytes"] > (1 << 31)) as g:
                shutil.copyfileobj(f, g, 1 << 20)


def header_dirs(python: str, source: pathlib.Path) -> list[pathlib.Path]:
    """Include folders for the build: the CUDA toolkit's first (as the sdist's build_tools finds it, then
    ``$CUDA_HOME`` and ``/usr/local/cuda``), then every ``include`` under the machine's ``nvidia`` wheels."""
    ask = ("import sys; sys.path.insert(0, '.'); from build_tools.utils import cuda_toolkit_include_path; "
           "print(cuda_toolkit_include_path() or '', flush=True); import nvidia; print('\\n'.join(nvidia.__path__))")
    found = subprocess.run([python, "-c", ask], cwd=source, capture_output=True, text=True, check=False)
    lines = found.stdout.splitlines()
    if found.returncode != 0:
        print(f"te_carry: looking for the toolkit and the nvidia wheels: {found.stderr.strip().splitlines()[-1:]}")
    toolkit = [pathlib.Path(lines[0])] if lines and lines[0] else []
    toolkit += [pathlib.Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "include",
                pathlib.Path("/usr/local/cuda/include")]
    dirs = [*toolkit, *(d for base in map(pathlib.Path, lines[1:])
                        for d in sorted(base.glob("**/include")) if d.is_dir())]
    return [d for i, d in enumerate(dirs) if d.is_dir() and d not in dirs[:i]]


def run(argv: list[str], env: dict, cwd: pathlib.Path | None, what: str) -> None:
    start = time.monotonic()
    print(f"te_carry: {what}: $ {shlex.join(argv)}", flush=True)
    code = subprocess.run(argv, env=env, cwd=cwd, check=False).returncode
    if code != 0:
        raise CarryError(f"te_carry: {what} failed (exit {code})")
    print(f"te_carry: {what} done ({time.monotonic() - start:.0f} s)", flush=True)


def build_env(python: str, site: pathlib.Path, work: pathlib.Path, source: pathlib.Path) -> dict:
    """The environment of the sdist build: headers found by name, ``-lnccl`` resolvable, the carried packages."""
    dirs = header_dirs(python, source)
    where = {h: next((d for d in dirs if (d / h).is_file()), None) for h in BUILD_HEADERS}
    for header, folder in where.items():
        print(f"te_carry: {header}: {folder or 'NOT FOUND'}")
    missing = [h for h, d in where.items() if d is None]
    if missing:
        raise CarryError(f"te_carry: the build needs {', '.join(missing)}, found in neither the CUDA toolkit's "
                         "include folder nor the nvidia-* wheels' ones: carry the wheel that ships it "
                         "(nvidia-cublas and nvidia-cuda-nvrtc for cublas*.h and nvrtc.h, nvidia-cudnn-cu13 for "
                         "cudnn*.h, nvidia-nccl-cu13 for nccl.h) in .cache/te/ and pack again")
    libdir = work / "lib"
    libdir.mkdir(parents=True, exist_ok=True)
    nccl = next((p for d in dirs for p in d.parent.glob("lib/libnccl.so.2")), None)
    if nccl is not None and not (libdir / "libnccl.so").exists():
        (libdir / "libnccl.so").symlink_to(nccl)
    env = dict(os.environ)
    join = lambda paths, old: os.pathsep.join([*map(str, paths), *([old] if old else [])])  # noqa: E731
    env["CPLUS_INCLUDE_PATH"] = join(dirs, env.get("CPLUS_INCLUDE_PATH"))
    env["LIBRARY_PATH"] = join([libdir], env.get("LIBRARY_PATH"))
    if nccl is not None:  # the extension needs libnccl.so.2, which nothing loads before it
        env["LDFLAGS"] = f"-Wl,-rpath,{nccl.parent} {env.get('LDFLAGS', '')}".strip()
    env["PYTHONPATH"] = join([site], env.get("PYTHONPATH"))
    env["NVTE_FRAMEWORK"] = "jax"
    # te_version() appends the commit of any git checkout around the sources; the versions must match PyPI's.
    env["NVTE_NO_LOCAL_VERSION"] = "1"
    return env


def assemble(root: pathlib.Path, work: pathlib.Path, site: pathlib.Path, python: str, jobs: int) -> None:
    manifest = read_manifest(root)
    work.mkdir(parents=True, exist_ok=True)
    stream = work / "payload.tar.xz"
    start = time.monotonic()
    join_parts(root, manifest, stream)
    files = unpack(stream, work / "unpacked")
    stream.unlink()
    print(f"te_carry: {len(manifest['parts'])} parts joined, sha256 {manifest['whole_sha256'][:16]}... ok, "
          f"{len(files)} files rebuilt and checked ({time.monotonic() - start:.0f} s)", flush=True)
    wheels = [f for f in files if f.suffix == ".whl"]
    sdists = [f for f in files if f.name == f"transformer_engine_jax-{TE_VERSION}.tar.gz"]
    if not sdists:
        raise CarryError(f"te_carry: transformer_engine_jax-{TE_VERSION}.tar.gz is not in this pack")
    if site.exists():
        shutil.rmtree(site)
    base_env = dict(os.environ)
    run([python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
         "--target", str(site), *map(str, wheels)], base_env, None, "install the wheels")
    build = work / "build"
    if build.exists():
        shutil.rmtree(build)
    build.mkdir()
    with tarfile.open(sdists[0]) as tar:
        tar.extractall(build, filter="data") if hasattr(tarfile, "data_filter") else tar.extractall(build)
    source = build / f"transformer_engine_jax-{TE_VERSION}"
    env = build_env(python, site, work, source)
    dist = work / "dist"
    # setup.py compiles its ~20 C++ files one by one; pybind11's ParallelCompile spreads them over the cores.
    driver = ("import runpy, sys; from pybind11.setup_helpers import ParallelCompile; "
              f"ParallelCompile(default={jobs}).install(); "
              f"sys.argv = ['setup.py', 'bdist_wheel', '-d', {str(dist)!r}]; "
              "runpy.run_path('setup.py', run_name='__main__')")
    run([python, "-c", driver], env, source, "build the transformer_engine_jax sdist")
    built = sorted(dist.glob("transformer_engine_jax-*.whl"))
    if len(built) != 1:
        raise CarryError(f"te_carry: expected one transformer_engine_jax wheel in {dist}, found {built}")
    run([python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
         "--target", str(site), "--upgrade", str(built[0])], base_env, None, "install the built extension")
    print("te_carry: TransformerEngine-JAX installed; use:")
    print(f"export PYTHONPATH={site}${{PYTHONPATH:+:$PYTHONPATH}} NVTE_FRAMEWORK=jax")


def smoke() -> None:
    """One LayerNormMLP value-and-grad step of TransformerEngine-JAX per FP8 recipe; raises unless all are finite."""
    import jax
    import jax.numpy as jnp
    import transformer_engine.jax as te
    import transformer_engine.jax.flax as te_flax
    from transformer_engine.common import recipe

    print(f"te_carry: transformer_engine.jax from {te.__file__} on {jax.devices()[0].device_kind}")
    x = jax.random.normal(jax.random.key(0), (256, 512), jnp.bfloat16)
    for name, rec in (("bf16", None), ("delayed", recipe.DelayedScaling()),
                      ("current", recipe.Float8CurrentScaling())):
        model = te_flax.LayerNormMLP(intermediate_dim=1024, activations=("gelu",), use_bias=False,
                                     dtype=jnp.bfloat16)
        with te.autocast(enabled=rec is not None, recipe=rec):
            variables = jax.jit(model.init)(jax.random.key(1), x)

            def loss(v, x):
                y, _ = model.apply(v, x, mutable=True)
                return jnp.sum(y.astype(jnp.float32))

            value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(variables, x)
        finite = bool(jnp.isfinite(value)) and all(bool(jnp.all(jnp.isfinite(g)))
                                                   for g in jax.tree_util.tree_leaves(grads))
        print(f"te_carry: smoke {name}: loss {float(value):.4g}, gradients finite: {finite}", flush=True)
        if not finite:
            raise CarryError(f"te_carry: smoke {name}: non-finite loss or gradients")


def calls_text(manifest: dict) -> str:
    """The device ``run`` calls, one a part, back to back (the machine keeps earlier parts only while warm)."""
    count = len(manifest["parts"])
    lines = [f"# {count} calls, back to back (a machine stays warm 30 s after a call; a cold one has lost the "
             "earlier parts)."]
    for part in manifest["parts"][:-1]:
        i = part["index"]
        lines.append(f"run(carry=[\".cache/te_part{i}\"], command=\"python3 tools/te_carry.py check {i}\")")
    last = count
    lines.append(f"run(carry=[\".cache/te_part{last}\"], timeout_s=600, command=\"python3 tools/te_carry.py check "
                 f"{last} && python3 tools/te_carry.py assemble && PYTHONPATH=/tmp/te_site NVTE_FRAMEWORK=jax "
                 "python3 -c 'import transformer_engine.jax as te; print(te.__file__)' && PYTHONPATH=/tmp/te_site "
                 "NVTE_FRAMEWORK=jax python3 tools/te_carry.py smoke\")")
    lines.append("# later calls on the same warm machine: start the command with "
                 "`export PYTHONPATH=/tmp/te_site${PYTHONPATH:+:$PYTHONPATH} NVTE_FRAMEWORK=jax;`")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    pk = sub.add_parser("pack", help="here: .cache/te/ -> .cache/te_partN/")
    pk.add_argument("--src", type=pathlib.Path, default=SRC)
    pk.add_argument("--part-mib", type=float, default=DEFAULT_PART_MIB)
    pk.add_argument("--preset", type=int, default=6, help="xz preset 0-9 (9 is slower and saves little: the "
                    "core library's GPU code is compressed already)")
    pk.add_argument("--gpu-arch", type=int, default=None, metavar="SM",
                    help="keep the shared libraries' GPU code for this SM only (90: H100/H200): one part instead of "
                         "five; the cut library differs from PyPI's (see keep_gpu_arch)")
    ck = sub.add_parser("check", help="there: check one part")
    ck.add_argument("index", type=int)
    asm = sub.add_parser("assemble", help="there: join, check, install, build")
    asm.add_argument("--work", type=pathlib.Path, default=pathlib.Path("/tmp/te_carry"))
    asm.add_argument("--site", type=pathlib.Path, default=pathlib.Path("/tmp/te_site"))
    asm.add_argument("--python", default="python3")
    asm.add_argument("--jobs", type=int, default=0, help="parallel C++ compiles (0: one a core)")
    sub.add_parser("calls", help="print the device run calls for the current pack")
    sub.add_parser("smoke", help="there, after assemble, under the printed environment: one TE LayerNormMLP "
                   "step per FP8 recipe on the GPU (runs TE's kernels, which the import alone does not)")
    args = p.parse_args(argv)
    try:
        if args.cmd == "pack":
            missing = [pat for pat in REQUIRED if not list(args.src.glob(pat))]
            if missing:
                raise CarryError(f"te_carry: {args.src} lacks {', '.join(missing)}: download them first "
                                 "(benchmarks/README.md, 'TransformerEngine-JAX on the GPU machine')")
            start = time.monotonic()
            manifest = pack(args.src, PARTS_ROOT, int(args.part_mib * (1 << 20)), args.preset, args.gpu_arch)
            for f in manifest["files"]:
                print(f"te_carry: {f['name']}: {f['bytes'] / 2**20:.1f} MiB")
            for part in manifest["parts"]:
                print(f"te_carry: .cache/te_part{part['index']}: {part['bytes'] / 2**20:.1f} MiB")
            print(f"te_carry: GPU code {manifest['gpu_code']}")
            print(f"te_carry: packed {manifest['whole_bytes'] / 2**20:.1f} MiB in {len(manifest['parts'])} parts "
                  f"({time.monotonic() - start:.0f} s)\n{calls_text(manifest)}")
        elif args.cmd == "check":
            manifest = read_manifest(PARTS_ROOT)
            check_part(PARTS_ROOT, manifest, args.index)
            present, missing = present_parts(PARTS_ROOT, manifest)
            print(f"te_carry: part {args.index} of {len(manifest['parts'])} ok; present {present}, missing {missing}")
        elif args.cmd == "assemble":
            assemble(PARTS_ROOT, args.work, args.site, args.python, args.jobs)
        elif args.cmd == "smoke":
            smoke()
        else:
            print(calls_text(read_manifest(PARTS_ROOT)))
    except CarryError as e:
        print(e, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
