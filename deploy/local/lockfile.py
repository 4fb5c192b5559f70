"""The dependency lock of deploy/local/install.sh: written from pip's install reports, read back as constraints.

`requirements.lock` beside this file is a pip requirements file: one `name==version --hash=sha256:...` per
distribution that install.sh installs (the project itself excepted), for the platform named on its
`# platform:` line. Subcommands (run with any Python 3.11+; nothing here imports a third-party package):

  write REPORT... [--pip-version V]  the lock, on stdout, from `pip install --dry-run --report` files
  platform                           this interpreter's platform key (what the lock's `# platform:` line names)
  covers LOCK                        exit 0 when LOCK was written for this interpreter's platform, 1 otherwise
  constraints LOCK                   the lock's pins without hashes (a constraints file for other platforms)
  diff LOCK FREEZE                   what a `pip freeze` has that differs from the lock (upgrades, additions)
"""

from __future__ import annotations

import json
import platform
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import date
from pathlib import Path

REGENERATE = "bash deploy/local/lock.sh"
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)")


@dataclass(frozen=True)
class Pin:
    """One locked distribution: its normalized name, exact version and the sha256 of the file installed."""

    name: str
    version: str
    sha256: str = ""


def normalize(name: str) -> str:
    """PEP 503's normalized name (what pip compares)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def platform_key() -> str:
    """The interpreter and platform a lock is valid for, e.g. `cp311-linux-x86_64`."""
    major, minor = sys.version_info[:2]
    return f"cp{major}{minor}-{sys.platform}-{platform.machine().lower()}"


def pins_from_report(report: dict[str, object]) -> list[Pin]:
    """Every distribution a `pip install --dry-run --report` would install, except local projects (no hash)."""
    pins = []
    for item in report["install"]:  # type: ignore[attr-defined]
        hashes = item["download_info"].get("archive_info", {}).get("hashes", {})
        if "sha256" not in hashes:
            continue  # the editable project itself: a directory, installed by install.sh with `-e .`
        meta = item["metadata"]
        pins.append(Pin(normalize(meta["name"]), meta["version"], hashes["sha256"]))
    return pins


def merge(pins: Iterable[Pin]) -> list[Pin]:
    """One pin per name, sorted; two reports that disagree on a version are an error, not a silent pick."""
    chosen: dict[str, Pin] = {}
    for pin in pins:
        other = chosen.setdefault(pin.name, pin)
        if other != pin:
            raise ValueError(f"two resolutions disagree on {pin.name}: {other.version} and {pin.version}")
    return [chosen[name] for name in sorted(chosen)]


def render(pins: list[Pin], pip_version: str) -> str:
    """The lock file's text."""
    header = [
        "# What deploy/local/install.sh installs (every distribution but the project itself), with the sha256 of",
        "# the file pip chose here; install.sh installs it with --require-hashes --no-deps, then `-e .`, then",
        "# `pip check`. torch's hash is that of the local CPU wheel this machine kind ships (the file CI installs).",
        f"# Regenerate (newest versions that pyproject.toml allows): {REGENERATE}",
        f"# pip: {pip_version}; written {date.today().isoformat()}",
        f"# platform: {platform_key()}",
    ]
    body = [f"{p.name}=={p.version} \\\n    --hash=sha256:{p.sha256}" for p in pins]
    return "\n".join(header + body) + "\n"


def read_pins(text: str) -> list[Pin]:
    """The pins of a lock (hashes included) or of a `pip freeze` (none); comments and editables skipped."""
    joined = text.replace("\\\n", " ")
    pins = []
    for line in joined.splitlines():
        match = _PIN.match(line.strip())
        if match is None:
            continue
        digest = re.search(r"--hash=sha256:([0-9a-f]{64})", line)
        pins.append(Pin(normalize(match[1]), match[2], digest[1] if digest else ""))
    return pins


def locked_platform(text: str) -> str:
    """The `# platform:` a lock names ('' when it names none)."""
    match = re.search(r"^# platform: (\S+)$", text, re.MULTILINE)
    return match[1] if match else ""


def constraints(pins: list[Pin]) -> str:
    """The lock's versions as a constraints file; a local label (torch's `+cpu`) dropped, so that the platform's
    own build of that version satisfies it."""
    return "".join(f"{p.name}=={p.version.split('+')[0]}\n" for p in pins)


def diff(locked: list[Pin], installed: list[Pin]) -> list[str]:
    """One line per distribution whose installed version is not the locked one."""
    before = {p.name: p.version for p in locked}
    lines = []
    for pin in sorted(installed, key=lambda p: p.name):
        old = before.get(pin.name)
        if old != pin.version:
            lines.append(f"  {pin.name}: {old or '(not in the lock)'} -> {pin.version}")
    gone = sorted(set(before) - {p.name for p in installed})
    lines += [f"  {name}: {before[name]} -> (not installed)" for name in gone]
    return lines


def main(argv: list[str]) -> int:
    command, args = argv[0], argv[1:]
    if command == "write":
        pip_version = args[args.index("--pip-version") + 1] if "--pip-version" in args else "?"
        reports = [a for a in args if a.endswith(".json")]
        pins = merge(p for path in reports for p in pins_from_report(json.loads(Path(path).read_text())))
        sys.stdout.write(render(pins, pip_version))
    elif command == "platform":
        print(platform_key())
    elif command == "covers":
        return 0 if locked_platform(Path(args[0]).read_text()) == platform_key() else 1
    elif command == "constraints":
        sys.stdout.write(constraints(read_pins(Path(args[0]).read_text())))
    elif command == "diff":
        lines = diff(read_pins(Path(args[0]).read_text()), read_pins(Path(args[1]).read_text()))
        print("\n".join(lines) if lines else "  (none: the newest versions are the locked ones)")
    else:
        raise SystemExit(f"lockfile.py: unknown command {command!r}; see the module docstring")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
