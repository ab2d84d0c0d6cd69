"""Which dtype a stage computes in: one decision, for the stage that loads its layers, the planner
that sizes them (`serve`, `plan`) and the operator.

`--dtype auto` takes the checkpoint's dtype on a GPU. On a CPU a 16-bit checkpoint computes in
float32 unless the CPU has native units for that type, as the CPU backends of model servers do:
without them torch emulates bfloat16 (measured on an AVX2-only EPYC: a 1,550-token prefill 20-30x
slower than in float32, decoding 2.5-3x slower), so "the checkpoint's" would be the slow choice.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")
# CPU flags (as /proc/cpuinfo names them) that give a 16-bit type native matrix units.
NATIVE_UNITS = {"bfloat16": ("avx512_bf16", "amx_bf16"), "float16": ("avx512_fp16", "amx_fp16")}


@dataclass(frozen=True)
class DtypeChoice:
    name: str  # float32 | float16 | bfloat16
    reason: str  # for the log: why this one

    def __str__(self) -> str:
        return f"{self.name} ({self.reason})"


def cpu_flags(cpuinfo: Path = CPUINFO) -> frozenset[str]:
    """The flags of this machine's CPU (empty where /proc/cpuinfo is not readable)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    line = next((ln for ln in text.splitlines() if ln.startswith(("flags", "Features"))), "")
    return frozenset(line.partition(":")[2].split())


def choose_dtype(requested: str | None, checkpoint_dtype: str, *, on_cpu: bool,
                 flags: frozenset[str] | None = None) -> DtypeChoice:
    """The compute dtype for `requested` (a dtype, or auto / None) of a checkpoint stored in
    `checkpoint_dtype`; `flags`: the CPU's (None: this machine's). A planner that cannot see the
    CPU the stage will run on (the operator) passes an empty set: it plans for float32, the larger."""
    if requested and requested != "auto":
        return DtypeChoice(requested, "as asked")
    if not on_cpu:
        return DtypeChoice(checkpoint_dtype, "the checkpoint's")
    if checkpoint_dtype not in NATIVE_UNITS:
        return DtypeChoice(checkpoint_dtype, "the checkpoint's")
    units = NATIVE_UNITS[checkpoint_dtype]
    have = [flag for flag in units if flag in (cpu_flags() if flags is None else flags)]
    if have:
        return DtypeChoice(checkpoint_dtype, f"the checkpoint's; this CPU computes it natively ({have[0]})")
    return DtypeChoice("float32", f"the checkpoint is {checkpoint_dtype}, which this CPU would emulate "
                                  f"(no {' or '.join(units)}); --dtype {checkpoint_dtype} forces it")
