"""The sandbox for untrusted code: limits, timeouts that kill whole process groups, isolation."""

from __future__ import annotations

import logging
import os
import threading
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
    assert "interfaces ['lo']" in out and "rootfs read-only" in out and "tmp writable" in out
    uid = int(out.split("uid ")[1])
    assert uid != 0 and (uid == 65534 or os.geteuid() == 0)  # as root: a host uid of the program's own


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


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


FLOOD = "import sys\nblock = b'x' * (1 << 20)\nfor _ in range({mb}):\n    sys.stdout.buffer.write(block)\n"


@pytest.mark.parametrize("isolate", MODES)
def test_a_flood_of_output_is_read_in_bounded_memory(isolate):
    """300 MB on stdout: the trainer keeps output_chars of it, its RSS does not grow with the flood
    (reading it whole and cutting afterwards cost ~3x the flood)."""
    peak, done = [_rss_mb()], threading.Event()

    def sample():
        while not done.is_set():
            peak.append(_rss_mb())
            time.sleep(0.01)

    before = _rss_mb()
    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        read = run_python(FLOOD.format(mb=300), Limits(output_mb=1024, wall_s=60, output_chars=1000), isolate=isolate)
    finally:
        done.set()
        sampler.join()
    assert read.ok and read.stdout == "x" * 1000 and not read.output_overflow
    assert max(peak) - before < 40, f"trainer RSS grew by {max(peak) - before:.0f} MB reading a 300 MB flood"


@pytest.mark.parametrize("isolate", MODES)
def test_output_past_its_cap_stops_the_program(isolate):
    start = time.perf_counter()
    capped = run_python(FLOOD.format(mb=100_000), Limits(output_mb=4, wall_s=30), isolate=isolate)
    assert capped.output_overflow and not capped.ok and not capped.timed_out
    assert time.perf_counter() - start < 10 and len(capped.stdout) == Limits().output_chars


@pytest.mark.parametrize("isolate", MODES)
def test_a_process_that_leaves_the_group_does_not_hold_the_run(isolate):
    """A grandchild in a session of its own keeps the output pipe open: the run still ends at its
    wall time (a wait for the pipe's end would last as long as the grandchild)."""
    token = f"lit_marl_escapee_{int(isolate)}"
    code = (
        "import os, time, sys\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        f"        os.execv('/bin/sleep', ['/bin/sleep', '7', '{token}'])\n"
        "    os._exit(0)\n"
        "time.sleep(60)\n"
    )
    start = time.perf_counter()
    result = run_python(code, Limits(wall_s=1.0), isolate=isolate)
    assert result.timed_out and time.perf_counter() - start < 4
    if isolate:  # its own PID namespace: nothing outlives the sandbox
        time.sleep(0.3)
        assert not _alive(token)


@pytest.mark.skipif(not bubblewrap_available(), reason="no bwrap")
def test_isolated_writes_are_bounded_in_total():
    code = (
        "import os\nwritten = 0\n"
        "try:\n"
        "    for i in range(64):\n"
        "        with open(f'/tmp/f{i}', 'wb') as f:\n"
        "            f.write(b'0' * (1 << 20))\n"
        "        written += 1\n"
        "except OSError as err:\n"
        "    print('stopped', err.errno)\n"
        "print('written', written)\n"
    )
    out = run_python(code, Limits(disk_mb=8, file_mb=4), isolate=True).stdout
    assert "stopped" in out and int(out.split("written ")[1]) <= 8


@pytest.mark.skipif(not bubblewrap_available(), reason="no bwrap")
def test_isolated_program_cannot_reach_the_trainers_pipes_or_processes():
    code = (
        "import os\n"
        "for path in ('/proc/1/fd/1', '/proc/1/fd/0', f'/proc/{os.getppid()}/fd/1'):\n"
        "    try:\n"
        "        open(path, 'w').write('forged')\n"
        "        print('reached', path)\n"
        "    except OSError:\n"
        "        pass\n"
        "print('pids', sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))\n"
    )
    result = run_python(code, isolate=True)
    assert "reached" not in result.stdout and "forged" not in result.stdout + result.stderr
    assert len(eval(result.stdout.split("pids ")[1])) <= 4  # its own PID namespace: no trainer in sight


@pytest.mark.skipif(not bubblewrap_available(), reason="no bwrap")
def test_process_limit_binds_also_when_the_trainer_is_root():
    code = (
        "import threading, time\nstarted = 0\n"
        "try:\n"
        "    for _ in range(64):\n"
        "        threading.Thread(target=time.sleep, args=(2,), daemon=True).start()\n"
        "        started += 1\n"
        "except RuntimeError:\n"
        "    pass\n"
        "print('started', started)\n"
    )
    result = run_python(code, Limits(processes=8), isolate=True)
    assert int(result.stdout.split("started ")[1]) < 8, result.stdout + result.stderr


def test_limits_are_checked():
    with pytest.raises(ValueError, match="Limits.disk_mb"):
        Limits(disk_mb=0)


@pytest.mark.skipif(not bubblewrap_available(), reason="no bwrap")
def test_without_setpriv_a_root_trainer_still_runs_isolated(monkeypatch, caplog):
    which = sandbox.shutil.which
    monkeypatch.setattr(sandbox.shutil, "which", lambda name: None if name == "setpriv" else which(name))
    monkeypatch.setattr(sandbox, "_warned_no_setpriv", False)
    with caplog.at_level(logging.WARNING, logger="lit_marl.sandbox"):
        result = run_python("print(6 * 7)", isolate=True)
    assert result.ok and result.stdout == "42\n" and result.isolated
    assert any("setpriv" in r.message for r in caplog.records) == (os.geteuid() == 0)
