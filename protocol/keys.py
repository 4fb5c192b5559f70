"""CurveZMQ keys (torch-free): key files, the keys one peer uses, the keys a server lets in, the rule for
binding without keys, and `infer-keygen`.

Key files are pyzmq's certificate format (zmq.auth): `NAME.key` holds a public key (hand it out),
`NAME.key_secret` the key pair (mode 0600, never leaves its peer). Keys are z85 text, 40 characters.

- The coordinator is the CURVE server: its secret key file and a directory of the public keys it lets in
  (`--curve-secret-key FILE --authorized-keys DIR`, the `*.key` files there: workers and clients).
- Workers and clients are CURVE clients: their own secret key file and the coordinator's public key file
  (`--curve-key FILE --coordinator-key FILE`).
- Without keys, traffic is plaintext and anyone who reaches the port is a client or a worker: the daemons
  bind only loopback addresses then, unless told the network is trusted (`--trusted-network`).

`infer-keygen NAME [NAME ...] [--dir D] [--force]` writes D/NAME.key and D/NAME.key_secret; one cluster's
set is `infer-keygen coordinator worker client --dir D` (ClusterKeyDir reads it back).
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import socket
import stat
import sys
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path

import zmq
import zmq.auth
from zmq.utils import z85

log = logging.getLogger("infer.keys")

PUBLIC_SUFFIX = ".key"
SECRET_SUFFIX = ".key_secret"
Z85_KEY_LEN = 40                                   # a 32-byte CURVE key in z85 text
CLUSTER_KEY_NAMES = ("coordinator", "worker", "client")
TRUSTED_NETWORK_HINT = "or --trusted-network if every host that can reach it is trusted"

PathLike = str | os.PathLike[str]


# ---- key files ---------------------------------------------------------------------------------------

def _z85_key(value: bytes, what: str) -> bytes:
    """`value` if it is a z85-encoded 32-byte key, else ValueError naming `what`."""
    if len(value) != Z85_KEY_LEN:
        raise ValueError(f"{what} is not a CURVE key: {len(value)} characters, expected {Z85_KEY_LEN} of z85")
    try:
        z85.decode(value)
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"{what} is not a CURVE key: not z85 text") from None
    return value


def read_key_file(path: PathLike) -> tuple[bytes, bytes | None]:
    """(public key, secret key or None) from a key file; ValueError saying what is wrong with the file."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ValueError(f"key file {p} does not exist (make key pairs with infer-keygen)")
    if p.is_dir():
        raise ValueError(f"key file {p} is a directory, not a key file")
    try:
        public, secret = zmq.auth.load_certificate(p)
    except OSError as e:
        raise ValueError(f"cannot read key file {p}: {e.strerror or e}") from None
    except ValueError:
        raise ValueError(f"{p} is not a CURVE key file (no public-key line; make one with infer-keygen)") \
            from None
    _z85_key(public, f"the public key in {p}")
    if secret is not None:
        _z85_key(secret, f"the secret key in {p}")
    return public, secret


def read_public_key(path: PathLike) -> bytes:
    """The public key in a key file (a `.key` or a `.key_secret` file)."""
    return read_key_file(path)[0]


def read_key_pair(path: PathLike) -> tuple[bytes, bytes]:
    """(public, secret) from a secret key file; ValueError for a public-only file or a mismatched pair."""
    p = Path(path).expanduser()
    public, secret = read_key_file(p)
    if secret is None:
        raise ValueError(f"{p} holds only a public key; a secret key file ({SECRET_SUFFIX}, written by "
                         f"infer-keygen next to the {PUBLIC_SUFFIX} file) is needed here")
    if zmq.curve_public(secret) != public:
        raise ValueError(f"the public key in {p} does not belong to its secret key (the file was edited?)")
    mode = p.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("secret key file %s is readable by others (mode %04o): chmod 600 %s", p, mode & 0o777, p)
    return public, secret


@dataclass(frozen=True)
class CurveKeys:
    """The CURVE keys one socket uses, z85 text.

    public_key, secret_key: this peer's pair.
    server_key: the public key of the server this peer connects to (a worker's or a client's coordinator, an
        EP peer's wake socket). None: the socket is a CURVE server (it accepts; a KeyGate decides who may).
    """

    public_key: bytes
    secret_key: bytes
    server_key: bytes | None = None

    def __post_init__(self) -> None:
        _z85_key(self.public_key, "public_key")
        _z85_key(self.secret_key, "secret_key")
        if self.server_key is not None:
            _z85_key(self.server_key, "server_key")
        if zmq.curve_public(self.secret_key) != self.public_key:
            raise ValueError("public_key does not belong to secret_key")

    @classmethod
    def server(cls, secret_file: PathLike) -> CurveKeys:
        """A server's keys (the coordinator's) from its secret key file."""
        return cls(*read_key_pair(secret_file))

    @classmethod
    def client(cls, secret_file: PathLike, server_public_file: PathLike) -> CurveKeys:
        """A client's keys (a worker's, a client's): its secret key file and the server's public key file."""
        return cls(*read_key_pair(secret_file), server_key=read_public_key(server_public_file))

    @classmethod
    def from_files(cls, secret_file: PathLike | None, server_public_file: PathLike | None, *,
                   flags: tuple[str, str] = ("curve_key", "coordinator_key")) -> CurveKeys | None:
        """Client keys when both files are given, None when neither is; else ValueError naming `flags`."""
        if secret_file is None and server_public_file is None:
            return None
        if secret_file is None or server_public_file is None:
            raise ValueError(f"{flags[0]} and {flags[1]} go together: give both (this peer's secret key file "
                             f"and the coordinator's public key file) or neither")
        return cls.client(secret_file, server_public_file)

    @property
    def is_server(self) -> bool:
        return self.server_key is None

    def as_server(self) -> CurveKeys:
        """The same pair as a server (an EP rank's wake socket accepts with the rank's own key)."""
        return replace(self, server_key=None)

    def towards(self, server_key: bytes) -> CurveKeys:
        """The same pair as a client of the server whose public key is `server_key`."""
        return replace(self, server_key=server_key)


class AuthorizedKeys:
    """The public keys a server lets in: the `*.key` files of one directory (secret files are never read).

    The directory is read again when its `*.key` files change (checked at each handshake, a directory
    listing), so keys are added and revoked without a restart; connections already made stay. A directory
    that cannot be read again keeps the previous set (logged).
    """

    def __init__(self, directory: PathLike) -> None:
        self.directory = Path(directory).expanduser()
        if not self.directory.is_dir():
            raise ValueError(f"authorized keys directory {self.directory} does not exist or is not a "
                             f"directory")
        self._signature = self._files_signature()
        self.keys = self._read()
        if not self.keys:
            raise ValueError(f"no public key files (*{PUBLIC_SUFFIX}) in {self.directory}: no worker or "
                             f"client could connect; copy their {PUBLIC_SUFFIX} files there (infer-keygen "
                             f"makes them)")

    def _files(self) -> list[Path]:
        return sorted(p for p in self.directory.iterdir() if p.name.endswith(PUBLIC_SUFFIX) and p.is_file())

    def _files_signature(self) -> tuple[tuple[str, int, int], ...]:
        try:
            return tuple((p.name, p.stat().st_mtime_ns, p.stat().st_size) for p in self._files())
        except OSError as e:
            raise ValueError(f"cannot list authorized keys directory {self.directory}: "
                             f"{e.strerror or e}") from None

    def _read(self) -> frozenset[bytes]:
        return frozenset(read_public_key(p) for p in self._files())

    def refresh(self) -> None:
        """Read the directory again if its key files changed since the last read."""
        try:
            signature = self._files_signature()
            if signature == self._signature:
                return
            keys = self._read()
        except ValueError as e:
            log.error("authorized keys not reloaded, keeping the %d loaded before: %s", len(self.keys), e)
            return
        self._signature, self.keys = signature, keys
        log.info("authorized keys reloaded from %s: %d key(s)", self.directory, len(keys))

    def allows(self, public_key: bytes) -> bool:
        """Is `public_key` (z85 text) one of the directory's keys (re-read first if it changed)?"""
        self.refresh()
        return public_key in self.keys


# ---- writing keys: infer-keygen ------------------------------------------------------------------

def _check_name(name: str) -> str:
    if not name or name.startswith(".") or "/" in name or os.sep in name or name.endswith(SECRET_SUFFIX):
        raise ValueError(f"bad key name {name!r}: a plain file name such as 'worker' (no '/', no leading "
                         f"'.')")
    return name


def key_paths(directory: PathLike, name: str) -> tuple[Path, Path]:
    """(public file, secret file) of key pair `name` in `directory`."""
    base = Path(directory).expanduser() / _check_name(name)
    return base.with_name(base.name + PUBLIC_SUFFIX), base.with_name(base.name + SECRET_SUFFIX)


def write_key_pair(directory: PathLike, name: str, *, force: bool = False) -> tuple[Path, Path]:
    """Write a fresh key pair `name` into `directory` (made 0700 if it does not exist): NAME.key (public,
    0644) and NAME.key_secret (the pair, 0600). FileExistsError if either file exists and not `force`.

    The files are made in a private temporary directory next to their destination and renamed into place,
    so the secret is never readable by others, not even for a moment."""
    public, secret = key_paths(directory, name)
    if not force:
        for path in (public, secret):
            if path.exists():
                raise FileExistsError(f"{path} exists: refusing to overwrite it (--force replaces the pair)")
    public.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=public.parent, prefix=".infer-keygen-") as tmp:   # mode 0700
        tmp_public, tmp_secret = zmq.auth.create_certificates(tmp, name)
        os.chmod(tmp_secret, 0o600)
        os.chmod(tmp_public, 0o644)
        os.replace(tmp_secret, secret)
        os.replace(tmp_public, public)
    return public, secret


@dataclass(frozen=True)
class ClusterKeyDir:
    """One cluster's keys in one directory, as `infer-keygen coordinator worker client --dir D` writes them.

    The coordinator uses coordinator.key_secret and lets in the directory's `*.key` files; every worker uses
    worker.key_secret, every client client.key_secret, both with coordinator.key. The directory must be
    readable where each daemon runs (a shared filesystem across nodes) and by no one else.
    """

    path: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path).expanduser().resolve())
        if not self.path.is_dir():
            raise ValueError(f"keys directory {self.path} does not exist (make it with `infer-keygen "
                             f"{' '.join(CLUSTER_KEY_NAMES)} --dir {self.path}`)")
        for name in CLUSTER_KEY_NAMES:
            read_key_pair(self.secret(name))

    @classmethod
    def create(cls, path: PathLike, *, force: bool = False) -> ClusterKeyDir:
        """Write a fresh set (the directory is made 0700)."""
        for name in CLUSTER_KEY_NAMES:
            write_key_pair(path, name, force=force)
        return cls(Path(path))

    def public(self, name: str) -> Path:
        return key_paths(self.path, name)[0]

    def secret(self, name: str) -> Path:
        return key_paths(self.path, name)[1]

    def coordinator_flags(self) -> list[str]:
        return ["--curve-secret-key", str(self.secret("coordinator")), "--authorized-keys", str(self.path)]

    def worker_flags(self) -> list[str]:
        return ["--curve-key", str(self.secret("worker")),
                "--coordinator-key", str(self.public("coordinator"))]

    def client_options(self) -> dict[str, str]:
        """InferenceClient's keyword options."""
        return {"curve_key": str(self.secret("client")), "coordinator_key": str(self.public("coordinator"))}


# ---- binding without keys ----------------------------------------------------------------------------

def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1, `localhost`, and names that resolve only to those. Wildcards (0.0.0.0, *,
    ::), interface names and names that do not resolve are not loopback."""
    host = host.strip().removeprefix("[").removesuffix("]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except (OSError, UnicodeError):
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


def refuse_open_bind(host: str, *, what: str, remedy: str) -> None:
    """ValueError unless `host` is a loopback address. For a listener with nothing protecting it: `what`
    names it, `remedy` says how to protect it; --trusted-network is always offered as the way out."""
    if not is_loopback(host):
        raise ValueError(f"refusing to run {what} on {host}, which is not a loopback address, without "
                         f"authentication: {remedy}, {TRUSTED_NETWORK_HINT}")


# ---- infer-keygen ------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="infer-keygen",
        description="Write CurveZMQ key pairs: NAME.key (public: give it to the coordinator's "
        "--authorized-keys directory, or to workers and clients as --coordinator-key) and NAME.key_secret "
        "(secret, mode 0600: it stays with its peer).",
        epilog=f"A whole cluster's set: infer-keygen {' '.join(CLUSTER_KEY_NAMES)} --dir D (infer-serve and "
        "the Slurm launcher take it as --keys-dir D).")
    p.add_argument("names", nargs="+", metavar="NAME",
                   help="key pair name(s): coordinator, worker, client, ...")
    p.add_argument("--dir", default=".", help="where to write the files (default: the current directory; "
                   "made with mode 0700 if missing)")
    p.add_argument("--force", action="store_true", help="replace existing key files")
    return p


def keygen(names: Iterable[str], directory: PathLike, force: bool) -> list[tuple[Path, Path]]:
    names = [_check_name(n) for n in names]
    if not force:   # refuse before writing anything
        for name in names:
            for path in key_paths(directory, name):
                if path.exists():
                    raise FileExistsError(f"{path} exists: refusing to overwrite it (--force replaces it)")
    return [write_key_pair(directory, name, force=force) for name in names]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        written = keygen(args.names, args.dir, args.force)
    except ValueError as e:
        print(f"infer-keygen: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"infer-keygen: {e}", file=sys.stderr)
        return 1
    for public, secret in written:
        print(f"{public} (public key {read_public_key(public).decode()})\n{secret} (secret, mode 0600)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
