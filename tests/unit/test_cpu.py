"""How a CPU run chooses its precision and threads (lit_marl/cpu.py), from given flags, cgroup files
and environments."""

from __future__ import annotations

import functools
import os
import types

import pytest
from jsonargparse import Namespace

from lit_marl import cli, cpu

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
        (AVX2_ONLY, {}, "32-true"),  # bf16 emulated: a quickstart step 12x slower than fp32
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


def test_arm_bf16_is_native_and_an_unreadable_cpu_gets_fp32_without_a_notice():
    assert cpu.auto_precision("cpu", frozenset({"fp", "asimd", "bf16"}), {}) == "bf16-mixed"
    assert cpu.auto_precision("cpu", frozenset(), {}) == "32-true"  # macOS: no /proc/cpuinfo to read
    assert cpu.slow_precision_notice("bf16-mixed", frozenset()) is None  # unknown is not "emulated"


def test_a_precision_asked_for_by_bf16_weights_names_that_setting():
    notice = cpu.slow_precision_notice("bf16-mixed", AVX2_ONLY, "model.memory.weights_dtype: bfloat16 needs it")
    assert notice.endswith("model.memory.weights_dtype: bfloat16 needs it") and "unset" not in notice


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_usable_cores_count_hyperthread_siblings_once(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    for number, core in enumerate([0, 1, 0, 1]):  # cpu2 and cpu3 are the siblings of cpu0 and cpu1
        write(tmp_path / f"cpu{number}" / "topology" / "core_id", f"{core}\n")
        write(tmp_path / f"cpu{number}" / "topology" / "physical_package_id", "0\n")
    assert cpu.usable_cpus(tmp_path / "none", "", tmp_path) == 2
    write(tmp_path / "cpu3" / "topology" / "physical_package_id", "1\n")  # another socket: its own core
    assert cpu.usable_cpus(tmp_path / "none", "", tmp_path) == 3
    assert cpu.usable_cpus(tmp_path / "none", "", tmp_path / "unreadable") == 4


def test_the_tightest_cgroup_quota_on_the_way_up_caps_the_cores(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    root = tmp_path / "cgroup"
    write(root / "system.slice" / "cpu.max", "300000 100000\n")  # a systemd slice: 3 CPUs
    write(root / "system.slice" / "job.scope" / "cpu.max", "max 100000\n")
    assert cpu.usable_cpus(root, "0::/system.slice/job.scope\n", tmp_path / "nosysfs") == 3
    assert cpu.usable_cpus(root, "0::/\n", tmp_path / "nosysfs") == 64


def test_a_containers_cpu_quota_caps_the_usable_cpus(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    usable = functools.partial(cpu.usable_cpus, own_cgroup="", sysfs=tmp_path / "nosysfs")
    assert usable(tmp_path / "none") == 64
    write(tmp_path / "v2" / "cpu.max", "150000 100000\n")  # 1.5 CPUs: 2 threads
    assert usable(tmp_path / "v2") == 2
    write(tmp_path / "unlimited" / "cpu.max", "max 100000\n")
    assert usable(tmp_path / "unlimited") == 64
    write(tmp_path / "v1" / "cpu" / "cpu.cfs_quota_us", "400000\n")
    write(tmp_path / "v1" / "cpu" / "cpu.cfs_period_us", "100000\n")
    assert usable(tmp_path / "v1") == 4
    write(tmp_path / "v1off" / "cpu" / "cpu.cfs_quota_us", "-1\n")
    write(tmp_path / "v1off" / "cpu" / "cpu.cfs_period_us", "100000\n")
    assert usable(tmp_path / "v1off") == 64


def test_threads_are_shared_between_a_nodes_ranks_unless_the_user_set_them(monkeypatch):
    monkeypatch.setattr(cpu, "usable_cpus", lambda: 8)
    assert cpu.threads_per_rank(1) == (8, "8 usable cores / 1 rank(s)")
    assert cpu.threads_per_rank(3) == (2, "8 usable cores / 3 rank(s)")
    assert cpu.threads_per_rank(16) == (1, "8 usable cores / 16 rank(s)")
    assert cpu.threads_per_rank(2, "3") == (3, "OMP_NUM_THREADS")
    assert cpu.threads_per_rank(2, "5,2") == (5, "OMP_NUM_THREADS")  # nested levels: the first is torch's
    assert cpu.threads_per_rank(2, "") == (4, "8 usable cores / 2 rank(s)")


def test_the_users_omp_num_threads_is_read_at_import_not_lightnings_or_ours(monkeypatch):
    """Lightning's launcher sets OMP_NUM_THREADS in each rank after lit_marl is imported; a process
    started by a run inherits the value lit_marl wrote (and its marker): neither is the user's."""
    monkeypatch.setattr(cpu, "_user_threads", None)
    monkeypatch.setattr(os, "environ", {"OMP_NUM_THREADS": "3"})
    cpu.thread_env(os.environ, torch_loaded=False)
    assert cpu._user_threads == "3"
    monkeypatch.setattr(os, "environ", {"OMP_NUM_THREADS": "2", cpu.OURS: "2"})
    cpu.thread_env(os.environ, torch_loaded=False)
    assert cpu._user_threads is None
    monkeypatch.setattr(os, "environ", {"OMP_NUM_THREADS": "6", cpu.OURS: "2"})  # the user's for a child
    cpu.thread_env(os.environ, torch_loaded=False)
    assert cpu._user_threads == "6"


def test_threads_sleep_when_idle_unless_the_user_chose_how_they_wait():
    environ = {}
    assert cpu.thread_env(environ, torch_loaded=False) is False
    assert environ == {"OMP_WAIT_POLICY": "PASSIVE"}
    for chosen in ({"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "10000"}, {"KMP_BLOCKTIME": "0"}):
        environ = dict(chosen)
        cpu.thread_env(environ, torch_loaded=False)
        assert environ == chosen
    # too late for a process that loaded torch first: it says so (its child processes get the policy)
    environ = {}
    assert cpu.thread_env(environ, torch_loaded=True) is True and environ["OMP_WAIT_POLICY"] == "PASSIVE"


def test_ranks_with_cpus_of_their_own_do_not_share_them_again(monkeypatch):
    class Env:
        creates_processes_externally = True

    trainer = types.SimpleNamespace(num_devices=4, strategy=types.SimpleNamespace(cluster_environment=Env()))
    monkeypatch.delenv("SLURM_CPUS_PER_TASK", raising=False)
    assert cpu.local_ranks(trainer) == 4  # torchrun without masks: the node's cores are shared out
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "8")
    assert cpu.local_ranks(trainer) == 1  # srun --cpus-per-task: the mask is this rank's already
    Env.creates_processes_externally = False
    assert cpu.local_ranks(trainer) == 4
    single = types.SimpleNamespace(num_devices=1, strategy=types.SimpleNamespace())  # no cluster environment
    assert cpu.local_ranks(single) == 1


@pytest.mark.parametrize(
    "accelerator, weights_dtype, cuda, expected",
    [
        ("cpu", "float32", True, "CPU"),
        ("auto", "float32", False, "CPU"),
        ("auto", "float32", True, None),
        ("gpu", "float32", False, None),
        (Namespace(class_path="lightning.pytorch.accelerators.CPUAccelerator"), "float32", True, "CPU"),
        ("cpu", "bfloat16", False, "bf16-mixed"),  # bf16 weights need bf16 autocast
    ],
)
def test_the_cli_gives_an_unset_precision_by_accelerator_and_weights(
    monkeypatch, accelerator, weights_dtype, cuda, expected
):

    monkeypatch.setattr(cli.torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(cli.torch.backends.mps, "is_available", lambda: False)
    monkeypatch.delenv(cpu.PRECISION_ENV, raising=False)
    model = Namespace(
        class_path="lit_marl.algorithms.GRPO", init_args=Namespace(memory={"weights_dtype": weights_dtype})
    )
    got = cli._unset_precision(accelerator, model)
    assert got == (cpu.auto_precision("cpu", environ={}) if expected == "CPU" else expected)
