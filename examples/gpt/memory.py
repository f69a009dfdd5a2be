"""Whether a compiled train step fits the memory it will run in (checked by examples/gpt/train.py before training).

XLA's memory analysis of the compiled step says how much it holds: its
arguments (the train state and the batch), its outputs, less what is donated
back, and its temporary buffers. On a GPU that is compared with the device's
memory; on a CPU (every device of the process shares the host's RAM) what the
step allocates beyond its arguments, on every device, with the RAM available
now. A step that cannot fit ends with ``StepTooLarge`` before the first step
runs, not with an allocation failure part way through.
"""

from __future__ import annotations

import contextlib
import os

import jax

__all__ = ["StepTooLarge", "check_fits", "memory_errors", "memory_figures", "out_of_memory", "step_description"]

_ADVICE = ("use a smaller model (--preset tiny or tiny-moe on a CPU; 125m, 1.3b and moe-1b are for a GPU), a "
           "smaller --batch or --seq-len, or more devices (--mesh)")


class StepTooLarge(ValueError):
    """The train step needs more memory than its devices have."""


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB"


def _host_available_bytes() -> int | None:
    """The RAM available to new allocations (/proc/meminfo's MemAvailable, else free pages), or None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_fits(compiled, what: str) -> None:
    """Raises ``StepTooLarge`` when ``compiled`` (a ``jax.stages.Compiled`` step) cannot fit its devices' memory.

    ``what`` names the step in the message (e.g. "the 125m preset's train step"). Nothing is checked when
    XLA or the platform gives no figures.
    """
    stats = compiled.memory_analysis()
    if stats is None:
        return
    arguments = stats.argument_size_in_bytes
    extra = stats.temp_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes
    device = jax.local_devices()[0]
    if device.platform == "cpu":
        devices = len(jax.local_devices())
        need, available = extra * devices, _host_available_bytes()
        where = (f"this machine has {_gb(available)} of RAM available" if available is not None else "")
        per = f" on each of {devices} CPU devices" if devices > 1 else ""
        detail = f"{_gb(extra)} of temporary buffers and outputs{per}, beyond the {_gb(arguments)} train state"
    else:
        available = (device.memory_stats() or {}).get("bytes_limit")
        need = arguments + extra
        where = f"each {device.device_kind} has {_gb(available)}" if available is not None else ""
        detail = f"{_gb(arguments)} of arguments, {_gb(extra)} of temporary buffers and outputs, per device"
    if available is not None and need > available:
        raise StepTooLarge(f"{what} needs {_gb(need)} ({detail}; XLA's memory analysis of the compiled step) and "
                           f"{where}: {_ADVICE}")


def out_of_memory(err: Exception, what: str) -> StepTooLarge | None:
    """A ``StepTooLarge`` explaining ``err`` when it is XLA's RESOURCE_EXHAUSTED (an allocation failed), else None."""
    if "RESOURCE_EXHAUSTED" not in str(err):
        return None
    first = str(err).strip().splitlines()[0][:300]
    return StepTooLarge(f"{what} ran out of memory ({first}): {_ADVICE}")


@contextlib.contextmanager
def memory_errors(what: str):
    """Context: XLA's RESOURCE_EXHAUSTED inside (an allocation the memory analysis did not foresee) is raised as
    the ``StepTooLarge`` that explains it (``out_of_memory``); any other error passes unchanged."""
    try:
        yield
    except jax.errors.JaxRuntimeError as err:
        too_large = out_of_memory(err, what)
        if too_large is None:
            raise
        raise too_large from err


def step_description(cfg) -> str:
    """The train step of ``cfg`` (an examples.gpt.config.RunConfig) as memory errors name it."""
    return f"the {cfg.preset} preset's train step (--batch {cfg.batch}, --seq-len {cfg.seq_len})"


def memory_figures(compiled) -> dict[str, float | None]:
    """The train step's device memory in GiB: ``peak_memory_gib``, the device's peak in use so far in this
    process (None where the device does not say, e.g. a CPU; one recipe per process gives each its own), and
    ``step_memory_gib``, what XLA's analysis of the compiled step holds (arguments + temporaries + outputs -
    donated; None without an analysis)."""
    stats = jax.local_devices()[0].memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    analysis = compiled.memory_analysis() if hasattr(compiled, "memory_analysis") else None
    step = None if analysis is None else (analysis.argument_size_in_bytes + analysis.temp_size_in_bytes
                                          + analysis.output_size_in_bytes - analysis.alias_size_in_bytes)
    return {"peak_memory_gib": None if peak is None else peak / 2**30,
            "step_memory_gib": None if step is None else step / 2**30}
