"""Where XLA put te_jax's custom calls: inside or outside its command buffers (CUDA graphs), read from a dump.

    python3 tools/xla_dump.py DUMP_DIR [--module jit_train_step]

DUMP_DIR is what ``XLA_FLAGS=--xla_dump_to=DUMP_DIR`` wrote (``--xla_dump_hlo_module_re=jit_train_step``
keeps it to the one module). For each compiled module whose name contains ``--module``, it prints one
JSON line: the te_jax custom calls of the optimized HLO, and how many custom-call thunks sit inside and
outside command buffers in the thunk sequence after XLA's thunk passes (the sequence before them when
the passes changed nothing; the HLO's ``command_buffer`` computations for an XLA that forms command
buffers in HLO).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

TE_JAX_CALL = re.compile(r'custom_call_target="te_jax_\w+"')


def te_jax_call_count(hlo: str) -> int:
    """The te_jax custom calls of an optimized HLO module's text."""
    return len(TE_JAX_CALL.findall(hlo))


def custom_call_thunks(thunks: str) -> tuple[int, int]:
    """(inside, outside) a command buffer: the kCustomCall thunks of a thunk-sequence dump.

    Each line of the dump names one thunk kind (after an optional ``NNN:`` id), indented under the
    thunk that holds it: a kCommandBuffer's commands are indented under it.
    """
    inside = outside = 0
    holders: list[tuple[int, str]] = []  # (indent, kind) of the thunks enclosing the current line
    for line in thunks.splitlines():
        match = re.match(r"^(\s*)(?:\d+:\s*)?(k[A-Z]\w*)", line)
        if not match:
            continue
        indent, kind = len(match.group(1)), match.group(2)
        while holders and holders[-1][0] >= indent:
            holders.pop()
        if kind == "kCustomCall":
            if any(k == "kCommandBuffer" for _, k in holders):
                inside += 1
            else:
                outside += 1
        holders.append((indent, kind))
    return inside, outside


def hlo_te_jax_calls_in_command_buffers(hlo: str) -> tuple[int, int]:
    """(inside, outside): te_jax custom calls in HLO computations named command_buffer*."""
    inside = outside = 0
    computation = ""
    for line in hlo.splitlines():
        header = re.match(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
        if header and not line.startswith(" "):
            computation = header.group(1)
        elif TE_JAX_CALL.search(line):
            if computation.startswith("command_buffer"):
                inside += 1
            else:
                outside += 1
    return inside, outside


def placements(dump: Path, module: str) -> list[dict]:
    """One record per dumped module whose name contains ``module``: its te_jax calls, and the custom calls
    inside / outside command buffers with the file that says so."""
    records = []
    for hlo in sorted(dump.glob(f"*{module}*after_optimizations.txt")):
        prefix = hlo.name.split(".")[0]  # module_NNNN
        name = hlo.name[len(prefix) + 1:].split(".")[0]
        text = hlo.read_text()
        found = [sorted(dump.glob(f"{prefix}.{name}.{pattern}")) for pattern in
                 ("*thunk_sequence_after_thunk_passes.txt", "*thunk_sequence.txt")]
        thunks = next((files[0] for files in found if files), None)
        if thunks is not None:
            inside, outside = custom_call_thunks(thunks.read_text())
        else:
            inside, outside = hlo_te_jax_calls_in_command_buffers(text)
        records.append({"module": f"{prefix}.{name}", "te_jax_calls": te_jax_call_count(text),
                        "custom_calls_inside": inside, "custom_calls_outside": outside,
                        "source": (thunks or hlo).name})
    return records


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dump", type=Path, help="the --xla_dump_to folder")
    p.add_argument("--module", default="jit_train_step", help="a part of the module's name")
    args = p.parse_args(argv)
    records = placements(args.dump, args.module)
    if not records:
        print(f"xla_dump: no optimized HLO of a module named *{args.module}* in {args.dump}", file=sys.stderr)
        return 1
    for record in records:
        print(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
