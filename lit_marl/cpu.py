"""What a CPU run is given without its user having to know: the precision the CPU computes natively,
and thread settings that lose little on a quiet machine and nothing catastrophic on a busy one.

- ``thread_env`` runs when ``lit_marl`` is imported, before torch loads OpenMP (libgomp reads its
  environment once, when it loads): OpenMP threads sleep at the end of a parallel region instead of
  spinning (``OMP_WAIT_POLICY=PASSIVE``). A spinning thread on a core another process wants turns
  every parallel region into a wait for the scheduler: a step measured ~10x slower under load.
- ``apply_threads`` runs in each rank when a run is set up: the usable CPUs (the affinity mask, and a
  container's CPU quota) shared between the node's ranks; one inter-op thread.
- ``auto_precision`` is ``trainer.precision`` for a CPU run that does not set it: ``bf16-mixed`` on a
  CPU with bf16 units (AMX or AVX-512 BF16), else ``32-true`` (bf16 emulated in fp32 arithmetic
  measured 12x slower than fp32). ``slow_precision_notice`` is the one line for an explicit choice
  the CPU will emulate.

The user's environment wins: ``OMP_NUM_THREADS``, ``OMP_WAIT_POLICY``, ``GOMP_SPINCOUNT``,
``KMP_BLOCKTIME`` are never replaced, and ``LIT_MARL_PRECISION`` replaces the automatic precision.
This module imports no torch at module level: ``lit_marl/__init__`` runs it first.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

# libgomp (torch's OpenMP on Linux), and Intel's, read these when they load: any of them set by the
# user means the user chose how threads wait
WAIT_SETTINGS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")
# set once by the first process of a run (children inherit it): whether OMP_NUM_THREADS was the user's.
# Lightning's launcher sets OMP_NUM_THREADS before it starts the other ranks (os.cpu_count() // ranks,
# blind to affinity masks and CPU quotas): that value is not a user's choice
USER_THREADS = "LIT_MARL_USER_OMP_NUM_THREADS"
PRECISION_ENV = "LIT_MARL_PRECISION"
# CPU flags (Linux /proc/cpuinfo names) that compute a precision natively
NATIVE = {
    "bf16": ("amx_bf16", "avx512_bf16"),
    "16": ("amx_fp16", "avx512_fp16"),
}


_late = False  # this process loaded torch (and its OpenMP) before lit_marl set the wait policy


def thread_env(environ=os.environ, torch_loaded: bool | None = None) -> bool:
    """Before torch loads: OpenMP threads that sleep when idle, unless the user chose how they wait.
    Records whether the user set OMP_NUM_THREADS (for ``apply_threads`` in every rank). Returns
    whether the policy came too late for this process (torch loaded already)."""
    global _late
    environ.setdefault(USER_THREADS, "1" if "OMP_NUM_THREADS" in environ else "0")
    if any(name in environ for name in WAIT_SETTINGS):
        return False
    environ["OMP_WAIT_POLICY"] = "PASSIVE"  # child processes (ranks, workers) load OpenMP with it
    late = "torch" in sys.modules if torch_loaded is None else torch_loaded
    if environ is os.environ:
        _late = late
    return late


def cpu_flags(cpuinfo: str | Path = "/proc/cpuinfo") -> frozenset[str]:
    """The CPU's feature flags (x86 ``flags``, Arm ``Features``); empty where there is no cpuinfo."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


# oneDNN (torch's CPU matmuls) told to stay below the ISAs with bf16/fp16 arithmetic emulates them
# whatever the CPU has (how a CPU without bf16 units is reproduced on one with them)
ONEDNN_ISA = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")
ISA_WITHOUT_HALF = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI")


def native_flags(kind: str, flags: frozenset[str] | None = None, environ=os.environ) -> list[str]:
    """The flags by which this CPU computes ``kind`` (``bf16`` or ``16``) natively; empty: emulated."""
    if any(environ.get(name, "").upper() in ISA_WITHOUT_HALF for name in ONEDNN_ISA):
        return []
    flags = cpu_flags() if flags is None else flags
    return [flag for flag in NATIVE.get(kind, ()) if flag in flags]


def _quota(cgroup_root: Path) -> float | None:
    """A container's CPU limit in CPUs (cgroup v2 ``cpu.max``, or v1's quota/period); None: no limit."""
    try:
        quota, period = (cgroup_root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int((cgroup_root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((cgroup_root / "cpu" / "cpu.cfs_period_us").read_text())
        return None if quota <= 0 else quota / period
    except (OSError, ValueError):
        return None


def usable_cpus(cgroup_root: str | Path = "/sys/fs/cgroup") -> int:
    """The CPUs this process may run on: its affinity mask, capped by a container's CPU quota
    (``os.cpu_count()`` counts the host's: 64 threads in a 2-CPU container spin on 2)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        cpus = os.cpu_count() or 1
    quota = _quota(Path(cgroup_root))
    if quota is not None:
        cpus = min(cpus, max(1, math.ceil(quota)))
    return max(1, cpus)


def threads_per_rank(local_ranks: int, environ=os.environ) -> tuple[int, str]:
    """Intra-op threads for each of a node's ``local_ranks`` and where the number came from."""
    if environ.get(USER_THREADS, "1" if "OMP_NUM_THREADS" in environ else "0") == "1":
        value = environ.get("OMP_NUM_THREADS", "")
        if value.isdigit() and int(value) > 0:
            return int(value), "OMP_NUM_THREADS"
    cpus = usable_cpus()
    return max(1, cpus // max(1, local_ranks)), f"{cpus} usable CPUs / {local_ranks} rank(s)"


def apply_threads(local_ranks: int) -> dict:
    """Set this process's torch threads (intra-op per rank, one inter-op thread); child processes
    inherit ``OMP_NUM_THREADS``. Returns what was set, for the run's report."""
    import torch  # deferred: this module runs before torch loads (lit_marl/__init__)

    threads, source = threads_per_rank(local_ranks)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    try:
        torch.set_num_interop_threads(1)  # nothing of a run forks inter-op work: one idle thread, not one per CPU
    except RuntimeError:  # set already, or inter-op work has started: keep what is there
        pass
    return {
        "threads": torch.get_num_threads(),
        "threads_from": source,
        "interop_threads": torch.get_num_interop_threads(),
        "wait_policy": wait_policy(),
    }


def wait_policy(environ=os.environ) -> str:
    """How this process's OpenMP threads wait, as the run reports it."""
    if _late and environ is os.environ:
        return "OpenMP's default (torch loaded before lit_marl: set OMP_WAIT_POLICY=PASSIVE or import lit_marl first)"
    chosen = [f"{name}={environ[name]}" for name in WAIT_SETTINGS if name in environ]
    return ", ".join(chosen) or "OpenMP's default"


def auto_precision(accelerator: str = "cpu", flags: frozenset[str] | None = None, environ=os.environ) -> str | None:
    """``trainer.precision`` for a run that does not set it: ``LIT_MARL_PRECISION`` if set; on a CPU,
    ``bf16-mixed`` where bf16 is native, else ``32-true``; None elsewhere (Lightning's default)."""
    if environ.get(PRECISION_ENV):
        return environ[PRECISION_ENV]
    if accelerator != "cpu":
        return None
    return "bf16-mixed" if native_flags("bf16", flags, environ) else "32-true"


def precision_kind(precision: str) -> str | None:
    """``bf16`` or ``16`` for a half-precision setting (``bf16-mixed``, ``16-true``, ...); None for fp32/64."""
    text = str(precision)
    if text.startswith("bf16"):
        return "bf16"
    if text.startswith("16") or text == "half":
        return "16"
    return None


def slow_precision_notice(precision: str, flags: frozenset[str] | None = None) -> str | None:
    """One line when a CPU run's precision is one this CPU emulates; None when it is native or fp32."""
    kind = precision_kind(precision)
    if kind is None or native_flags(kind, flags):
        return None
    wanted = " or ".join(NATIVE[kind])
    return (
        f"lit-marl: trainer.precision={precision} on a CPU without {kind} units (no {wanted} in its flags): "
        f"{kind} is emulated here and can be ~10x slower than 32-true; leave trainer.precision unset to let "
        "lit-marl choose from the CPU"
    )


def configure(trainer) -> dict:
    """A run's threads (every rank) and, on rank zero of a CPU run, one line saying what it runs with
    and one more when its precision is emulated here. Returns the choices (tests read them)."""
    from lightning.pytorch.accelerators import CPUAccelerator  # deferred: lit_marl/__init__ runs this module first

    report = apply_threads(trainer.num_devices)
    report["precision"] = str(trainer.precision)
    if isinstance(trainer.accelerator, CPUAccelerator) and trainer.is_global_zero:
        flags = cpu_flags()
        kind = precision_kind(report["precision"])
        native = native_flags(kind, flags) if kind else []
        how = f" ({kind} native: {', '.join(native)})" if native else ""
        print(
            f"lit-marl: CPU run: precision {report['precision']}{how}; {report['threads']} threads per rank "
            f"({report['threads_from']}); {report['interop_threads']} inter-op thread(s); OpenMP wait: "
            f"{report['wait_policy']}",
            file=sys.stderr,
        )
        notice = slow_precision_notice(report["precision"], flags)
        if notice:
            print(notice, file=sys.stderr)
    return report
