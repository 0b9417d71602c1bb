"""The sandbox for untrusted code: limits, timeouts that kill whole process groups, isolation."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

import lit_marl.sandbox as sandbox
from lit_marl.sandbox import Limits, bubblewrap_available, run_many, run_python

MODES = [False, pytest.param(True, marks=pytest.mark.skipif(not bubblewrap_available(), reason="no bwrap"))]


@pytest.mark.parametrize("isolate", MODES)
def test_runs_and_reports(isolate):
    ok = run_python("print(6 * 7)", isolate=isolate)
    assert ok.ok and ok.stdout == "42\n" and ok.isolated == isolate
    failed = run_python("raise SystemExit(3)", isolate=isolate)
    assert failed.returncode == 3 and not failed.ok
    crashed = run_python("1 / 0", isolate=isolate)
    assert crashed.returncode == 1 and "ZeroDivisionError" in crashed.stderr


def _alive(token: str) -> bool:
    """Whether any process on the machine runs a command line containing ``token``."""
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if token in cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                return True
        except OSError:  # the process ended meanwhile
            continue
    return False


@pytest.mark.parametrize("isolate", MODES)
def test_timeout_kills_the_whole_process_group(isolate):
    token = f"sleep 4242.{int(isolate)}"
    code = f"import subprocess, time\nsubprocess.Popen({token.split()!r})\ntime.sleep(60)\n"
    start = time.perf_counter()
    result = run_python(code, Limits(wall_s=1.0), isolate=isolate)
    assert result.timed_out and result.returncode is None and not result.ok
    assert time.perf_counter() - start < 10
    time.sleep(0.2)
    assert not _alive(token), "the program's child survived the timeout"


@pytest.mark.parametrize("isolate", MODES)
def test_memory_and_file_size_limits(isolate):
    memory = run_python("x = bytearray(1024 ** 3)", Limits(memory_mb=256), isolate=isolate)
    assert memory.returncode != 0 and "MemoryError" in memory.stderr
    big = run_python("open('f', 'wb').write(b'0' * (4 * 1024 * 1024))", Limits(file_mb=1), isolate=isolate)
    assert big.returncode != 0
    small = run_python("open('f', 'wb').write(b'0' * 1024)", Limits(file_mb=1), isolate=isolate)
    assert small.ok


def test_cpu_limit_stops_a_busy_loop():
    result = run_python("while True: pass", Limits(cpu_s=1, wall_s=20), isolate=False)
    assert not result.timed_out and result.returncode != 0  # SIGXCPU, well before the wall timeout


@pytest.mark.skipif(not bubblewrap_available(), reason="no bwrap")
def test_isolation_no_network_read_only_root_unprivileged():
    code = (
        "import os, socket\n"
        "print('interfaces', [name for _, name in socket.if_nameindex()])\n"
        "try:\n    open('/etc/lit_marl_probe', 'w'); print('rootfs writable')\n"
        "except OSError:\n    print('rootfs read-only')\n"
        "open('/tmp/scratch', 'w').write('ok'); print('tmp writable')\n"
        "print('uid', os.getuid())\n"
    )
    out = run_python(code, isolate=True).stdout
    assert "interfaces ['lo']" in out and "rootfs read-only" in out and "tmp writable" in out and "uid 65534" in out


def test_many_programs_run_in_parallel():
    start = time.perf_counter()
    results = run_many(["import time; time.sleep(1.5); print('done')"] * 4, max_workers=4)
    elapsed = time.perf_counter() - start
    assert [r.stdout for r in results] == ["done\n"] * 4
    assert elapsed < 4.5, f"4 x 1.5 s took {elapsed:.1f} s: not run in parallel"  # sequential: 6 s


def test_missing_bubblewrap_warns_once(monkeypatch, caplog):
    monkeypatch.setattr(sandbox.shutil, "which", lambda name: None)
    monkeypatch.setattr(sandbox, "_warned_no_bwrap", False)
    with caplog.at_level(logging.WARNING, logger="lit_marl.sandbox"):
        first = run_python("print(1)")
        run_python("print(2)")
    assert not first.isolated and first.ok
    assert [r.message.count("bubblewrap") > 0 for r in caplog.records] == [True]
