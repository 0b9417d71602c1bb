"""How a CPU run chooses its precision and threads (lit_marl/cpu.py), from given flags, cgroup files
and environments."""

from __future__ import annotations

import os

import pytest

from lit_marl import cpu

X86 = "processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16\n\nprocessor\t: 1\n"
ARM = "processor\t: 0\nFeatures\t: fp asimd bf16 sve\n"
AVX2_ONLY = frozenset({"sse2", "avx2", "fma"})
ZEN4 = frozenset({"avx2", "avx512f", "avx512_bf16"})
SAPPHIRE_RAPIDS = frozenset({"avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16"})


def test_flags_are_read_from_cpuinfo(tmp_path):
    (tmp_path / "x86").write_text(X86)
    (tmp_path / "arm").write_text(ARM)
    assert cpu.cpu_flags(tmp_path / "x86") == {"fpu", "sse2", "avx2", "avx512f", "avx512_bf16"}
    assert "bf16" in cpu.cpu_flags(tmp_path / "arm")
    assert cpu.cpu_flags(tmp_path / "missing") == frozenset()


@pytest.mark.parametrize(
    "flags, environ, expected",
    [
        (AVX2_ONLY, {}, "32-true"),  # bf16 emulated: ~10x slower than fp32
        (ZEN4, {}, "bf16-mixed"),  # AVX-512 BF16
        (SAPPHIRE_RAPIDS, {}, "bf16-mixed"),  # AMX
        (ZEN4, {"ONEDNN_MAX_CPU_ISA": "AVX2"}, "32-true"),  # oneDNN held below bf16: emulated
        (ZEN4, {"DNNL_MAX_CPU_ISA": "avx512_core"}, "32-true"),
        (ZEN4, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}, "bf16-mixed"),
        (AVX2_ONLY, {"LIT_MARL_PRECISION": "bf16-mixed"}, "bf16-mixed"),  # the environment replaces the choice
        (ZEN4, {"LIT_MARL_PRECISION": "32-true"}, "32-true"),
    ],
)
def test_a_cpu_runs_precision_is_what_its_units_compute(flags, environ, expected):
    assert cpu.auto_precision("cpu", flags, environ) == expected


def test_other_accelerators_keep_lightnings_default():
    assert cpu.auto_precision("cuda", SAPPHIRE_RAPIDS, {}) is None
    assert cpu.auto_precision("cuda", SAPPHIRE_RAPIDS, {"LIT_MARL_PRECISION": "bf16-mixed"}) == "bf16-mixed"


@pytest.mark.parametrize(
    "precision, flags, slow",
    [
        ("bf16-mixed", AVX2_ONLY, True),
        ("bf16-true", AVX2_ONLY, True),
        ("16-mixed", ZEN4, True),  # fp16 needs avx512_fp16 or amx_fp16
        ("16-mixed", SAPPHIRE_RAPIDS, False),
        ("bf16-mixed", ZEN4, False),
        ("32-true", AVX2_ONLY, False),
        ("64-true", AVX2_ONLY, False),
    ],
)
def test_an_emulated_explicit_precision_gets_one_line_naming_the_field_and_fix(precision, flags, slow):
    notice = cpu.slow_precision_notice(precision, flags)
    assert (notice is not None) == slow
    if slow:
        assert "\n" not in notice and f"trainer.precision={precision}" in notice and "unset" in notice


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_a_containers_cpu_quota_caps_the_usable_cpus(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
    assert cpu.usable_cpus(tmp_path / "none") == 64
    write(tmp_path / "v2" / "cpu.max", "150000 100000\n")  # 1.5 CPUs: 2 threads
    assert cpu.usable_cpus(tmp_path / "v2") == 2
    write(tmp_path / "unlimited" / "cpu.max", "max 100000\n")
    assert cpu.usable_cpus(tmp_path / "unlimited") == 64
    write(tmp_path / "v1" / "cpu" / "cpu.cfs_quota_us", "400000\n")
    write(tmp_path / "v1" / "cpu" / "cpu.cfs_period_us", "100000\n")
    assert cpu.usable_cpus(tmp_path / "v1") == 4
    write(tmp_path / "v1off" / "cpu" / "cpu.cfs_quota_us", "-1\n")
    write(tmp_path / "v1off" / "cpu" / "cpu.cfs_period_us", "100000\n")
    assert cpu.usable_cpus(tmp_path / "v1off") == 64


def test_threads_are_shared_between_a_nodes_ranks_unless_the_user_set_them(monkeypatch):
    monkeypatch.setattr(cpu, "usable_cpus", lambda: 8)
    assert cpu.threads_per_rank(1, {}) == (8, "8 usable CPUs / 1 rank(s)")
    assert cpu.threads_per_rank(3, {}) == (2, "8 usable CPUs / 3 rank(s)")
    assert cpu.threads_per_rank(16, {}) == (1, "8 usable CPUs / 16 rank(s)")
    assert cpu.threads_per_rank(2, {"OMP_NUM_THREADS": "3"}) == (3, "OMP_NUM_THREADS")
    # Lightning's launcher set OMP_NUM_THREADS for the ranks it started: not the user's choice
    launched = {"OMP_NUM_THREADS": "4", cpu.USER_THREADS: "0"}
    assert cpu.threads_per_rank(2, launched) == (4, "8 usable CPUs / 2 rank(s)")


def test_threads_sleep_when_idle_unless_the_user_chose_how_they_wait():
    environ = {}
    assert cpu.thread_env(environ, torch_loaded=False) is False
    assert environ == {"OMP_WAIT_POLICY": "PASSIVE", cpu.USER_THREADS: "0"}
    for chosen in ({"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "10000"}, {"KMP_BLOCKTIME": "0"}):
        environ = dict(chosen, OMP_NUM_THREADS="2")
        cpu.thread_env(environ, torch_loaded=False)
        assert environ == dict(chosen, OMP_NUM_THREADS="2", **{cpu.USER_THREADS: "1"})
    # too late for a process that loaded torch first: it says so (its child processes get the policy)
    environ = {}
    assert cpu.thread_env(environ, torch_loaded=True) is True and environ["OMP_WAIT_POLICY"] == "PASSIVE"
