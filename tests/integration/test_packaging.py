"""The built wheel carries the migrations: sdist from a copy of the checkout, the wheel from the
unpacked sdist (as ``python -m build`` does), installed with ``pip install --target`` and
``--prefix``; ``cdgpc-admin db upgrade`` then creates the schema from outside any checkout."""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
import sys
import tarfile
from importlib.util import find_spec
from pathlib import Path

import pytest

pytestmark = pytest.mark.packaging

REPO = Path(__file__).resolve().parents[2]
#: what a build reads from the checkout (the sdist decides the rest)
SOURCES = (
    "pyproject.toml",
    "setup.cfg",
    "README.md",
    "MANIFEST.in",
    "slurm_cdgpc",
    "sql",
    "daemon",
)
#: PEP 517 hooks of the setuptools backend, run without build isolation (no downloads)
BUILD = (
    "import sys; from setuptools import build_meta as backend; "
    "print(getattr(backend, sys.argv[1])(sys.argv[2]))"
)


def _run(argv: list[str], cwd: Path, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(
        argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    if done.returncode != 0:
        pytest.fail(f"{' '.join(argv[:4])} exited with {done.returncode}:\n{done.stderr[-3000:]}")
    return done.stdout


def _unavailable(reason: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true but {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if find_spec("setuptools") is None:
        _unavailable("setuptools is not installed (pip install -e '.[test]')")
    if find_spec("setuptools.command.bdist_wheel") is None and find_spec("wheel") is None:
        _unavailable("building a wheel needs setuptools >= 70.1 or the wheel package")
    root = tmp_path_factory.mktemp("build")
    source = root / "checkout"
    source.mkdir()
    for name in SOURCES:
        if (REPO / name).is_dir():
            ignore = shutil.ignore_patterns("__pycache__")
            shutil.copytree(REPO / name, source / name, symlinks=True, ignore=ignore)
        elif (REPO / name).exists():
            shutil.copy2(REPO / name, source / name)
    dist = root / "dist"
    sdist = dist / _run([sys.executable, "-c", BUILD, "build_sdist", str(dist)], source).split()[-1]
    with tarfile.open(sdist) as archive:
        if hasattr(tarfile, "data_filter"):
            archive.extractall(root / "unpacked", filter="data")
        else:  # Python < 3.11.4 (Debian 12's 3.11.2) has no filters; the sdist is our own
            archive.extractall(root / "unpacked")
    [unpacked] = (root / "unpacked").iterdir()
    name = _run([sys.executable, "-c", BUILD, "build_wheel", str(dist)], unpacked).split()[-1]
    return dist / name


def _install(wheel: Path, how: str, into: Path) -> Path:
    """Install ``wheel`` with ``pip install --<how> <into>``; the directory that holds the
    package (for ``PYTHONPATH``)."""
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--no-index",
            # without it, --prefix uninstalls the running environment's copy (the editable
            # install in .venv), and the Slurm hooks, run with -I, no longer find the package
            "--ignore-installed",
            "--disable-pip-version-check",
            "--no-warn-script-location",
            f"--{how}",
            str(into),
            str(wheel),
        ],
        into.parent,
    )
    [package] = {p.parent for p in into.glob("**/slurm_cdgpc/__init__.py")}
    return package.parent


@pytest.mark.parametrize("how", ["target", "prefix"])
def test_db_upgrade_from_an_installed_wheel(wheel: Path, how: str, tmp_path: Path) -> None:
    site = _install(wheel, how, tmp_path / how)
    outside = tmp_path / "elsewhere"  # neither the checkout nor the install
    outside.mkdir()
    database = outside / "cdgpc.db"
    config = outside / "cdgpc.toml"
    config.write_text(f'[store]\nurl = "sqlite:///{database}"\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("CDGPC_")}
    env["PYTHONPATH"] = str(site)
    [script] = (tmp_path / how).glob("**/bin/cdgpc-admin")

    out = _run([str(script), "db", "upgrade", "--config", str(config)], outside, env)
    latest = len(list((REPO / "sql" / "sqlite").glob("*.sql")))
    assert out.strip().endswith(f"schema at {latest}")
    with sqlite3.connect(database) as conn:
        assert conn.execute("SELECT max(version) FROM schema_version").fetchone() == (latest,)

    # the files came from the install, not from a checkout or a share/ directory
    found = _run(
        [sys.executable, "-c", "import slurm_cdgpc.store.migrate as m; print(m.sql_dir())"],
        outside,
        env,
    )
    assert Path(found.strip()).is_relative_to(site)
