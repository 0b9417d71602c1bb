"""The built wheel, installed on its own (not the editable install), runs a code-environment fit."""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import yaml

from helpers import REPO_ROOT

# top-level folders of the checkout that are no sources: build leftovers, environments, run outputs
_NOT_SOURCES = {".git", ".venv", ".venv-comlrl", "build", "dist", "lightning_logs", ".pytest_cache", "checkpoints"}
_OFFLINE = ["--no-deps", "--no-index", "--disable-pip-version-check", "-q"]  # pip fetches nothing


def _copy_sources(dest: Path) -> None:
    """The checkout without build leftovers: a stale build/lib would ship in the wheel too."""

    def ignore(folder, names):
        top = Path(folder) == REPO_ROOT
        return {n for n in names if n == "__pycache__" or (top and (n in _NOT_SOURCES or n.endswith(".egg-info")))}

    shutil.copytree(REPO_ROOT, dest, ignore=ignore, symlinks=True)


def _run(cmd, timeout=300, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, **kwargs)


def test_wheel_installs_and_fits_the_code_env(tmp_path):
    """Why: a hand-kept package list left lit_marl.envs.code out of the wheel, and the editable install hid it."""
    src, wheelhouse, venv, workdir = (tmp_path / n for n in ("src", "wheelhouse", "venv", "run"))
    _copy_sources(src)
    built = _run([sys.executable, "-m", "pip", "wheel", *_OFFLINE, "--no-build-isolation", "-w", wheelhouse, src])
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = wheelhouse.glob("lit_marl-*.whl")

    # every module of lit_marl/ and callbacks/ (as lit_marl.callbacks) ships, and nothing else of the checkout
    with zipfile.ZipFile(wheel) as zf:
        shipped = set(zf.namelist())
    modules = {p.relative_to(src).as_posix() for p in (src / "lit_marl").rglob("*.py")}
    modules |= {
        "lit_marl/callbacks/" + p.relative_to(src / "callbacks").as_posix() for p in (src / "callbacks").rglob("*.py")
    }
    assert "lit_marl/envs/code/harness.py" in modules
    assert modules - shipped == set(), "missing from the wheel"
    assert {n for n in shipped if not n.startswith(("lit_marl/", "lit_marl-"))} == set(), "shipped by mistake"

    # A scratch venv holds the wheel; the dependencies come from this interpreter's site-packages through
    # a .pth file. Its lines are only added to sys.path: the .pth files in those folders (the editable
    # install's finder among them) are not run, so the checkout cannot shadow the wheel (checked below).
    made = _run([sys.executable, "-m", "venv", "--without-pip", venv])
    assert made.returncode == 0, made.stdout + made.stderr
    python = venv / "bin" / "python"
    purelib = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]).stdout.strip())
    outer = [*site.getsitepackages(), *([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])]
    (purelib / "_outer_site_packages.pth").write_text("".join(f"{p}\n" for p in outer))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}
    env.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")  # caches: from conftest
    # pip runs in the scratch venv (so the console script is its own); it sees the outer editable lit_marl
    # on sys.path, and --ignore-installed keeps it from trying to uninstall that one
    installed = _run([python, "-m", "pip", "install", *_OFFLINE, "--ignore-installed", wheel], env=env)
    assert installed.returncode == 0, installed.stdout + installed.stderr

    workdir.mkdir()
    probe = (
        "import lit_marl, lit_marl.envs.code as e, lit_marl.callbacks as c\nfor m in lit_marl, e, c: print(m.__file__)"
    )
    imported = _run([python, "-c", probe], cwd=workdir, env=env)
    assert imported.returncode == 0, imported.stdout + imported.stderr
    assert len(imported.stdout.splitlines()) == 3, imported.stdout
    for path in imported.stdout.splitlines():
        assert Path(path).resolve().is_relative_to(purelib.resolve()), f"not imported from the wheel: {path}"

    config = yaml.safe_load((REPO_ROOT / "configs" / "magrpo" / "code_tiny_2turn.yaml").read_text())
    data = config["data"]["init_args"]
    for key in ("train_path", "val_path"):
        assert not Path(data[key]).is_absolute(), data[key]
        data[key] = str(REPO_ROOT / data[key])
    config["trainer"]["logger"]["init_args"]["save_dir"] = str(tmp_path / "logs")
    (workdir / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))

    fit = _run([venv / "bin" / "lit-marl", "fit", "--config", "config.yaml"], cwd=workdir, env=env, timeout=420)
    assert fit.returncode == 0, (fit.stdout + fit.stderr)[-4000:]
    assert list((tmp_path / "logs").rglob("events.out.tfevents.*")), "the fit logged nothing"
