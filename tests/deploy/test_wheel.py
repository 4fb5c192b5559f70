"""The package built as a wheel (what `pip install .` installs on a node without the checkout, as a Slurm job's image
may) holds every file of src/infer that the product reads: each module and subpackage, and the C kernels' sources
that kernels/cpu_kernels.py compiles on first use. An editable install reads the checkout and cannot show a
subpackage that pyproject's package list leaves out (client/api/routes was left out once: a wheel's HTTP front
failed to import)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHIPPED = (".py", ".c", ".h")


def _tracked(*paths: str) -> list[str]:
    return subprocess.run(
        ["git", "-C", str(REPO), "ls-files", *paths], capture_output=True, text=True, check=True
    ).stdout.split()


def _tracked_package_files() -> set[str]:
    return {str(Path(name).relative_to("src")) for name in _tracked("src/infer") if name.endswith(SHIPPED)}


def test_the_wheel_holds_every_module_and_kernel_source_of_the_package(tmp_path):
    source = tmp_path / "source"  # the tracked files only, built outside the checkout (a build writes beside them)
    for name in _tracked("pyproject.toml", "README.md", "src"):
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, source / name)
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), "."],
        cwd=source,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stderr[-2000:]
    (wheel,) = tmp_path.glob("infer-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        shipped = {name for name in archive.namelist() if name.endswith(SHIPPED)}
    tracked = _tracked_package_files()
    assert "infer/client/api/routes/__init__.py" in tracked and "infer/kernels/cpu/gemv.c" in tracked
    assert sorted(tracked - shipped) == []  # nothing the checkout has is missing from the wheel
    assert sorted(shipped - tracked) == []  # and nothing else (no stray build or cache folder) is in it
