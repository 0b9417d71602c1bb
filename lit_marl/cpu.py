"""What a CPU run is given without its user having to know: the precision the CPU computes natively,
and thread settings that lose little on a quiet machine and nothing catastrophic on a busy one.

- ``thread_env`` runs when ``lit_marl`` is imported, before torch loads OpenMP (libgomp reads its
  environment once, when it loads): OpenMP threads sleep at the end of a parallel region instead of
  spinning (``OMP_WAIT_POLICY=PASSIVE``). A spinning thread on a core another process wants turns
  every parallel region into a wait for the scheduler: beside one busy process per core a quickstart
  step took 3.8-4.9x its quiet time with spinning threads, 2.0-2.1x with sleeping ones.
- ``apply_threads`` runs in each rank when a run is set up: the usable cores (the physical cores of
  the affinity mask, capped by the CPU quotas of the process's cgroups) shared between the node's
  ranks; one inter-op thread.
- ``auto_precision`` is ``trainer.precision`` for a CPU run that does not set it: ``bf16-mixed`` on a
  CPU with bf16 units (AMX, AVX-512 BF16, Arm's BF16), else ``32-true`` (bf16 emulated in fp32 arithmetic
  measured 12x slower than fp32). ``slow_precision_notice`` is the one line for an explicit choice
  the CPU will emulate.

The user's environment wins: ``OMP_NUM_THREADS``, ``OMP_WAIT_POLICY``, ``GOMP_SPINCOUNT``,
``KMP_BLOCKTIME`` are never replaced, and ``LIT_MARL_PRECISION`` replaces the automatic precision. A
``torch.set_num_threads`` call in a script before the fit is replaced: the environment is the way.
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
# the OMP_NUM_THREADS lit_marl wrote itself (a child process inherits both: its value is not a user's)
OURS = "LIT_MARL_OMP_NUM_THREADS"
PRECISION_ENV = "LIT_MARL_PRECISION"
# CPU flags (Linux /proc/cpuinfo names: x86 ``flags``, Arm ``Features``) that compute a precision natively
NATIVE = {
    "bf16": ("amx_bf16", "avx512_bf16", "bf16"),
    "16": ("amx_fp16", "avx512_fp16"),
}

_late = False  # this process loaded torch (and its OpenMP) before lit_marl set the wait policy
# OMP_NUM_THREADS as the user gave it to this process (read at import: Lightning's launcher sets its own
# value in each rank later, os.cpu_count() // ranks, blind to affinity masks and CPU quotas)
_user_threads: str | None = None


def thread_env(environ=os.environ, torch_loaded: bool | None = None) -> bool:
    """Before torch loads: OpenMP threads that sleep when idle, unless the user chose how they wait;
    and the user's OMP_NUM_THREADS, if any, kept for ``apply_threads``. Returns whether the policy came
    too late for this process (torch loaded already)."""
    global _late, _user_threads
    value = environ.get("OMP_NUM_THREADS")
    user = value if value != environ.get(OURS) else None
    late = False
    if not any(name in environ for name in WAIT_SETTINGS):
        environ["OMP_WAIT_POLICY"] = "PASSIVE"  # child processes (ranks, workers) load OpenMP with it
        late = "torch" in sys.modules if torch_loaded is None else torch_loaded
    if environ is os.environ:  # this process's own
        _user_threads, _late = user, late
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


def _quota_at(folder: Path) -> float | None:
    """One cgroup's CPU limit in CPUs (v2 ``cpu.max``, or v1's quota over period); None: no limit."""
    try:
        quota, period = (folder / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
        return None if quota <= 0 else quota / period
    except (OSError, ValueError):
        return None


def _quota(cgroup_root: Path, own: str | None) -> float | None:
    """The tightest CPU limit on this process: its cgroup's and every parent's up to the root (v2), or
    the v1 ``cpu`` controller's; ``own`` is ``/proc/self/cgroup``'s text (None: read it)."""
    if own is None:
        try:
            own = Path("/proc/self/cgroup").read_text()
        except OSError:
            own = ""
    folders = []
    for line in own.splitlines():
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        base = cgroup_root if controllers == "" else cgroup_root / "cpu" if "cpu" in controllers.split(",") else None
        if base is None:
            continue
        parts = [part for part in path.strip().split("/") if part]
        folders += [base.joinpath(*parts[:n]) for n in range(len(parts), -1, -1)]
    folders += [cgroup_root, cgroup_root / "cpu"]
    limits = [limit for limit in map(_quota_at, dict.fromkeys(folders)) if limit is not None]
    return min(limits) if limits else None


def _cores(cpus: set[int], sysfs: Path) -> int:
    """Physical cores among ``cpus`` (hyperthread siblings count once, as torch's default thread count
    does); the CPU count where the topology cannot be read."""
    cores = set()
    for number in cpus:
        topology = sysfs / f"cpu{number}" / "topology"
        try:
            cores.add(
                ((topology / "physical_package_id").read_text().strip(), (topology / "core_id").read_text().strip())
            )
        except OSError:
            return len(cpus)
    return len(cores) or len(cpus)


def usable_cpus(
    cgroup_root: str | Path = "/sys/fs/cgroup",
    own_cgroup: str | None = None,
    sysfs: str | Path = "/sys/devices/system/cpu",
) -> int:
    """The cores this process may compute on: the physical cores of its affinity mask, capped by its
    containers' CPU quotas (``os.cpu_count()`` counts the host's CPUs: 64 threads in a 2-CPU container
    spin on 2)."""
    try:
        cpus = _cores(os.sched_getaffinity(0), Path(sysfs))
    except AttributeError:  # macOS, Windows: no affinity masks
        cpus = os.cpu_count() or 1
    quota = _quota(Path(cgroup_root), own_cgroup)
    if quota is not None:
        cpus = min(cpus, max(1, math.ceil(quota)))
    return max(1, cpus)


def threads_per_rank(local_ranks: int, user: str | None = None) -> tuple[int, str]:
    """Intra-op threads for each of a node's ``local_ranks``, and where the number came from: the
    user's OMP_NUM_THREADS (its first level: ``4,2`` is 4), else the usable cores shared out."""
    first = (user or "").split(",")[0].strip()
    if first.isdigit() and int(first) > 0:
        return int(first), "OMP_NUM_THREADS"
    cpus = usable_cpus()
    return max(1, cpus // max(1, local_ranks)), f"{cpus} usable cores / {local_ranks} rank(s)"


def local_ranks(trainer) -> int:
    """The ranks that share this process's cores: the node's ranks, or 1 where a scheduler gave each
    rank its own CPUs (SLURM's ``--cpus-per-task``: the affinity mask is the rank's already)."""
    environment = getattr(trainer.strategy, "cluster_environment", None)  # none for a single device
    external = getattr(environment, "creates_processes_externally", False)
    return 1 if external and os.environ.get("SLURM_CPUS_PER_TASK") else max(1, trainer.num_devices)


def apply_threads(ranks: int) -> dict:
    """Set this process's torch threads (intra-op per rank, one inter-op thread); child processes
    inherit ``OMP_NUM_THREADS``. Returns what was set, for the run's report."""
    import torch  # deferred: this module runs before torch loads (lit_marl/__init__)

    threads, source = threads_per_rank(ranks, _user_threads)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    if source != "OMP_NUM_THREADS":
        os.environ["OMP_NUM_THREADS"] = os.environ[OURS] = str(threads)
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


def wait_policy() -> str:
    """How this process's OpenMP threads wait, as the run reports it."""
    if _late:
        return "OpenMP's default (torch loaded before lit_marl: set OMP_WAIT_POLICY=PASSIVE or import lit_marl first)"
    chosen = [f"{name}={os.environ[name]}" for name in WAIT_SETTINGS if name in os.environ]
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
    if text.startswith("16"):
        return "16"
    return None


def slow_precision_notice(precision: str, flags: frozenset[str] | None = None, why: str = "") -> str | None:
    """One line when a CPU run's precision is one this CPU emulates; None when it is native, fp32, or
    the CPU's flags cannot be read (no /proc/cpuinfo: macOS). ``why``: what asked for it, if not the user."""
    flags = cpu_flags() if flags is None else flags
    kind = precision_kind(precision)
    if kind is None or not flags or native_flags(kind, flags):
        return None
    fix = why or "set trainer.precision: 32-true, or leave it unset to let lit-marl choose from the CPU"
    return (
        f"lit-marl: trainer.precision={precision} on a CPU without {kind} units (none of {', '.join(NATIVE[kind])} "
        f"in its flags): {kind} is emulated here (a quickstart step measured 12x slower than 32-true); {fix}"
    )


def configure(trainer) -> None:
    """A run's threads (every rank) and, on rank zero of a CPU run, one line saying what it runs with
    and one more when its precision is emulated here."""
    from lightning.pytorch.accelerators import CPUAccelerator  # deferred: lit_marl/__init__ runs this module first

    report = apply_threads(local_ranks(trainer))
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
        bf16_weights = (
            getattr(trainer.lightning_module, "memory", None) is not None
            and trainer.lightning_module.memory.weights_dtype == "bfloat16"
        )
        why = (
            "model.memory.weights_dtype: bfloat16 needs it; weights_dtype: float32 computes in fp32"
            if bf16_weights
            else ""
        )
        notice = slow_precision_notice(report["precision"], flags, why)
        if notice:
            print(notice, file=sys.stderr)
