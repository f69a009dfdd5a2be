"""Packs DeepGEMM's source into .cache/deepgemm/ for benchmarks/bench_deepgemm.py on a GPU machine (issue 43).

DeepGEMM (github.com/deepseek-ai/DeepGEMM, MIT) is an anchor for te_jax's block-scaled GEMMs, never a dependency
and never committed: its source comes from the search tool's ``fetch`` (a bare git mirror under /work/.mirror),
and this script writes the files its build needs into a git-ignored folder that the GPU run carries:

* ``csrc/`` (the C++ host module, built there with the machine's torch), ``deep_gemm/`` (its Python package and
  the CUDA headers its kernels are compiled from at run time by nvcc) and ``LICENSE``, from ``--commit``;
* ``third-party/fmt/include/`` and fmt's licence, from the fmt commit DeepGEMM pins (its submodule), taken from
  ``--fmt-git``;
* ``te_jax_pack.json``: which commits these are, and the CUTLASS commit DeepGEMM pins.

CUTLASS is not packed: DeepGEMM pins CUTLASS 4.2.1, whose ``include/`` differs from 4.2.0's (te_jax's
``.cache/cutlass``, which the GPU run carries anyway) only in an SM100 epilogue builder, the epilogue dispatch
policies and version.h, none of which DeepGEMM includes; benchmarks/bench_deepgemm.py points DeepGEMM at those
headers. Tests, docs, CI files, the setup script and the other third-party folders stay out.

Usage (here, where the mirrors are):
  python3 tools/pack_deepgemm.py                 # -> .cache/deepgemm (about 1.6 MB)
  python3 tools/pack_deepgemm.py --commit <sha>  # another DeepGEMM commit
"""

from __future__ import annotations

import argparse
import io
import json
import pathlib
import shutil
import subprocess
import sys
import tarfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
MIRRORS = pathlib.Path("/work/.mirror")
# The newest DeepGEMM commit at packing time (2026-06-23, version 2.6.1): SM90 FP8 1D2D kernels, CUDA 13 support.
DEFAULT_COMMIT = "54e22612409371d6364144b69086735beb54e98b"
DEEPGEMM_PATHS = ("csrc", "deep_gemm", "LICENSE")
FMT_PATHS = ("include/fmt", "LICENSE")
MANIFEST = "te_jax_pack.json"


def git(repo: pathlib.Path, *args: str) -> bytes:
    """The output of ``git -C repo args``; stops with git's message on failure."""
    proc = subprocess.run(["git", "-C", str(repo), *args], capture_output=True)
    if proc.returncode != 0:
        raise SystemExit(f"pack_deepgemm: git {' '.join(args)} in {repo} failed: {proc.stderr.decode().strip()}")
    return proc.stdout


def submodule_commit(repo: pathlib.Path, commit: str, path: str) -> str:
    """The commit a submodule (gitlink) at ``path`` is pinned to in ``commit``."""
    line = git(repo, "ls-tree", commit, path).decode().split()
    if len(line) < 3 or line[1] != "commit":
        raise SystemExit(f"pack_deepgemm: {path} is not a submodule in {commit}")
    return line[2]


def extract(repo: pathlib.Path, commit: str, paths: tuple[str, ...], dest: pathlib.Path) -> int:
    """Writes ``paths`` of ``commit`` under ``dest`` (``git archive``); returns the bytes written."""
    data = git(repo, "archive", "--format=tar", commit, *paths)
    total = 0
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        members = [m for m in tar.getmembers() if m.isfile() or m.isdir()]
        tar.extractall(dest, members=members, filter="data")
        total = sum(m.size for m in members if m.isfile())
    return total


def folder_bytes(path: pathlib.Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def pack(deepgemm_git: pathlib.Path, commit: str, fmt_git: pathlib.Path, out: pathlib.Path) -> dict:
    """Writes the pack into ``out`` (replacing what was there) and returns its manifest."""
    full = git(deepgemm_git, "rev-parse", f"{commit}^{{commit}}").decode().strip()
    fmt_commit = submodule_commit(deepgemm_git, full, "third-party/fmt")
    cutlass_commit = submodule_commit(deepgemm_git, full, "third-party/cutlass")
    git(fmt_git, "cat-file", "-e", f"{fmt_commit}^{{commit}}")  # the pinned fmt must be in the mirror
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    extract(deepgemm_git, full, DEEPGEMM_PATHS, out)
    fmt_dest = out / "third-party" / "fmt"
    extract(fmt_git, fmt_commit, FMT_PATHS, fmt_dest)
    manifest = {
        "deepgemm_commit": full,
        "deepgemm_date": git(deepgemm_git, "show", "-s", "--format=%cI", full).decode().strip(),
        "fmt_commit": fmt_commit,
        "fmt_describe": git(fmt_git, "describe", "--tags", fmt_commit).decode().strip(),
        "cutlass_commit_pinned": cutlass_commit,
        "cutlass_note": "not packed: bench_deepgemm.py uses te_jax's .cache/cutlass (4.2.0) headers",
    }
    manifest["bytes"] = folder_bytes(out)
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--deepgemm-git", type=pathlib.Path, default=MIRRORS / "deepseek-ai+DeepGEMM" / "repo",
                   help="DeepGEMM's git directory (the search tool's fetch of github:deepseek-ai/DeepGEMM)")
    p.add_argument("--commit", default=DEFAULT_COMMIT, help="the DeepGEMM commit to pack")
    p.add_argument("--fmt-git", type=pathlib.Path, default=MIRRORS / "fmtlib+fmt" / "repo",
                   help="fmt's git directory (fetch of github:fmtlib/fmt), holding the commit DeepGEMM pins")
    p.add_argument("--out", type=pathlib.Path, default=ROOT / ".cache" / "deepgemm")
    args = p.parse_args(argv)
    for name, repo in (("--deepgemm-git", args.deepgemm_git), ("--fmt-git", args.fmt_git)):
        if not repo.exists():
            raise SystemExit(f"pack_deepgemm: {name} {repo} does not exist; bring it with the search tool's fetch")
    manifest = pack(args.deepgemm_git, args.commit, args.fmt_git, args.out.resolve())
    print(json.dumps(manifest, indent=1))
    print(f"pack_deepgemm: wrote {args.out} ({manifest['bytes'] / 2**20:.2f} MiB); carry it with .cache/cutlass")
    return 0


if __name__ == "__main__":
    sys.exit(main())
