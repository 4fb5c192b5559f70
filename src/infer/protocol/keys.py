"""CurveZMQ keys (torch-free): key files, the keys one peer uses, the keys a server lets in and the role of
each, the rule for binding without keys, and `infer-keygen`.

Key files are pyzmq's certificate format (zmq.auth): `NAME.key` holds a public key (hand it out),
`NAME.key_secret` the key pair (mode 0600, never leaves its peer). Keys are z85 text, 40 characters.

- The coordinator is the CURVE server: its secret key file and the public keys it lets in, each with its role
  (infer.protocol.roles): `--curve-secret-key FILE --authorized-keys DIR` with DIR/workers/*.key,
  DIR/clients/*.key, DIR/admins/*.key, and / or one directory per role (`--worker-keys`, `--client-keys`,
  `--admin-keys`). A flat DIR (the layout before roles) is refused with a message saying where keys go.
- Workers and clients are CURVE clients: their own secret key file and the coordinator's public key file
  (`--curve-key FILE --coordinator-key FILE`).
- Without keys, traffic is plaintext and anyone who reaches the port is a client, a worker or an
  administrator: the daemons bind only loopback addresses then, unless told the network is trusted
  (`--trusted-network`).

`infer-keygen NAME [NAME ...] [--dir D] [--role ROLE] [--force]` writes D[/ROLE folder]/NAME.key and
NAME.key_secret; one cluster's set is `infer-keygen --cluster --dir D` (ClusterKeyDir reads it back).
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
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TypedDict

import zmq
import zmq.auth
from zmq.utils import z85

from infer.protocol.roles import NO_ROLES, ROLE_FOLDERS, Role

log = logging.getLogger("infer.keys")

PUBLIC_SUFFIX = ".key"
SECRET_SUFFIX = ".key_secret"
Z85_KEY_LEN = 40  # a 32-byte CURVE key in z85 text
CLUSTER_KEY_ROLES = {"coordinator": None, "worker": Role.WORKER, "client": Role.CLIENT, "admin": Role.ADMIN}
CLUSTER_KEY_NAMES = tuple(CLUSTER_KEY_ROLES)
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
        raise ValueError(f"{p} is not a CURVE key file (no public-key line; make one with infer-keygen)") from None
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
        raise ValueError(
            f"{p} holds only a public key; a secret key file ({SECRET_SUFFIX}, written by "
            f"infer-keygen next to the {PUBLIC_SUFFIX} file) is needed here"
        )
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
    def from_files(
        cls,
        secret_file: PathLike | None,
        server_public_file: PathLike | None,
        *,
        flags: tuple[str, str] = ("curve_key", "coordinator_key"),
    ) -> CurveKeys | None:
        """Client keys when both files are given, None when neither is; else ValueError naming `flags`."""
        if secret_file is None and server_public_file is None:
            return None
        if secret_file is None or server_public_file is None:
            raise ValueError(
                f"{flags[0]} and {flags[1]} go together: give both (this peer's secret key file "
                f"and the coordinator's public key file) or neither"
            )
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


class _KeyFolder:
    """The `*.key` files of one directory (secret files are never read); a missing directory holds none."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def files(self) -> list[Path]:
        if not self.directory.is_dir():
            return []
        return sorted(p for p in self.directory.iterdir() if p.name.endswith(PUBLIC_SUFFIX) and p.is_file())

    def signature(self) -> tuple[tuple[str, int, int], ...]:
        try:
            return tuple((p.name, p.stat().st_mtime_ns, p.stat().st_size) for p in self.files())
        except OSError as e:
            raise ValueError(f"cannot list authorized keys directory {self.directory}: {e.strerror or e}") from None

    def read(self) -> frozenset[bytes]:
        return frozenset(read_public_key(p) for p in self.files())


def role_folders(directory: PathLike) -> dict[Role, Path]:
    """The role folders of an `--authorized-keys DIR`: DIR/workers, DIR/clients, DIR/admins (at least one
    must exist; a missing one holds no keys until it is made). ValueError for a directory without any,
    naming what to do; in particular for the flat layout from before key roles (`*.key` files directly in
    DIR), which is never read as "every role"."""
    d = Path(directory).expanduser()
    if not d.is_dir():
        raise ValueError(f"authorized keys directory {d} does not exist or is not a directory")
    folders = {role: d / name for role, name in ROLE_FOLDERS.items()}
    if any(folder.is_dir() for folder in folders.values()):
        return folders  # one made later is read then
    flat = sorted(p.name for p in d.iterdir() if p.name.endswith(PUBLIC_SUFFIX))
    layout = ", ".join(f"{d / name}/ ({role.value}s)" for role, name in ROLE_FOLDERS.items())
    if flat:
        raise ValueError(
            f"{d} holds public key files directly ({', '.join(flat[:4])}"
            f"{', ...' if len(flat) > 4 else ''}): the layout from before key roles, where any key "
            f"could act as a worker, a client or an administrator. Each key now goes in the folder "
            f"of its role: {layout}; move the files there (or name one directory per role with "
            f"--worker-keys, --client-keys, --admin-keys). No key is let in until then"
        )
    raise ValueError(
        f"no public key files (*{PUBLIC_SUFFIX}) in {d}: no worker or client could connect; put "
        f"each key's {PUBLIC_SUFFIX} file in the folder of its role: {layout} (infer-keygen "
        f"--cluster --dir {d} makes a whole set)"
    )


class AuthorizedKeys:
    """The public keys a server lets in, and the roles of each (a KeyRoles): one directory of `*.key` files
    per role (secret files are never read). A key may be in several; admins may also act as clients.

    The directories are read again when their `*.key` files change: at each handshake (`allows`, from the
    KeyGate's thread) and whenever the server calls `refresh()` (the coordinator: every heartbeat interval),
    so keys are added, moved and revoked without a restart. `generation` counts the reloads: the coordinator
    then re-checks the peers already connected, and cuts off those whose key lost its role. A directory that
    cannot be read again keeps the previous set (logged); a role folder that was removed holds no keys.
    """

    def __init__(self, folders: Mapping[Role, PathLike]) -> None:
        self.folders = {role: _KeyFolder(Path(d).expanduser()) for role, d in folders.items()}
        self._lock = threading.Lock()
        self.generation = 0
        self._signature = self._files_signature()
        self._roles = self._read()
        if not self._roles:
            where = ", ".join(str(f.directory) for f in self.folders.values())
            raise ValueError(
                f"no public key files (*{PUBLIC_SUFFIX}) in {where}: no worker or client could "
                f"connect; copy their {PUBLIC_SUFFIX} files there (infer-keygen makes them)"
            )

    @classmethod
    def from_options(
        cls,
        directory: PathLike | None = None,
        *,
        workers: PathLike | None = None,
        clients: PathLike | None = None,
        admins: PathLike | None = None,
    ) -> AuthorizedKeys:
        """`--authorized-keys DIR` (its role folders) and / or one directory per role; a per-role directory
        replaces DIR's folder for that role. ValueError when none is given or one is unusable."""
        folders: dict[Role, PathLike] = dict(role_folders(directory)) if directory is not None else {}
        for role, path in ((Role.WORKER, workers), (Role.CLIENT, clients), (Role.ADMIN, admins)):
            if path is not None:
                if not Path(path).expanduser().is_dir():
                    raise ValueError(f"{role.value} keys directory {path} does not exist or is not a directory")
                folders[role] = path
        if not folders:
            raise ValueError(
                "no authorized keys: give --authorized-keys DIR (with role folders workers/, "
                "clients/, admins/) or --worker-keys / --client-keys / --admin-keys DIR"
            )
        return cls(folders)

    @property
    def keys(self) -> frozenset[bytes]:
        """Every key let in, whatever its roles."""
        return frozenset(self._roles)

    def roles_of(self, key: bytes) -> frozenset[Role]:
        """The roles of `key` in the set loaded last (no disk access); empty when it is not authorized."""
        return self._roles.get(key, NO_ROLES)

    def describe(self) -> str:
        """'1 worker key(s) in D/workers, 2 client key(s) in D/clients, no admin keys'."""
        parts = []
        for role in Role:
            folder = self.folders.get(role)
            n = sum(role in roles for roles in self._roles.values())
            parts.append(
                f"{n} {role.value} key(s) in {folder.directory}"
                if folder is not None and n
                else f"no {role.value} keys"
            )
        return ", ".join(parts)

    def _files_signature(self) -> tuple:
        return tuple((role.value, folder.signature()) for role, folder in self.folders.items())

    def _read(self) -> dict[bytes, frozenset[Role]]:
        roles: dict[bytes, set[Role]] = {}
        for role, folder in self.folders.items():
            for key in folder.read():
                roles.setdefault(key, set()).add(role)
        return {key: frozenset(r) for key, r in roles.items()}

    def refresh(self) -> bool:
        """Read the directories again if their key files changed since the last read; True if the set
        changed. Safe to call from several threads."""
        with self._lock:
            try:
                signature = self._files_signature()
                if signature == self._signature:
                    return False
                roles = self._read()
            except ValueError as e:
                log.error("authorized keys not reloaded, keeping the %d loaded before: %s", len(self._roles), e)
                return False
            changed = roles != self._roles
            self._signature, self._roles = signature, roles
            if changed:
                self.generation += 1
                log.info("authorized keys reloaded: %s", self.describe())
            return changed

    def allows(self, public_key: bytes) -> bool:
        """Does `public_key` (z85 text) hold any role (the directories re-read first if they changed)?"""
        self.refresh()
        return public_key in self._roles


# ---- writing keys: infer-keygen ------------------------------------------------------------------


def _check_name(name: str) -> str:
    if not name or name.startswith(".") or "/" in name or os.sep in name or name.endswith(SECRET_SUFFIX):
        raise ValueError(f"bad key name {name!r}: a plain file name such as 'worker' (no '/', no leading '.')")
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
    with tempfile.TemporaryDirectory(dir=public.parent, prefix=".infer-keygen-") as tmp:  # mode 0700
        tmp_public, tmp_secret = zmq.auth.create_certificates(tmp, name)
        os.chmod(tmp_secret, 0o600)
        os.chmod(tmp_public, 0o644)
        os.replace(tmp_secret, secret)
        os.replace(tmp_public, public)
    return public, secret


class ClientKeyOptions(TypedDict, total=False):
    """InferenceClient's CurveZMQ keyword options (both or neither): its secret key file and the coordinator's
    public key file."""

    curve_key: str
    coordinator_key: str


@dataclass(frozen=True)
class ClusterKeyDir:
    """One cluster's keys in one directory, as `infer-keygen --cluster --dir D` writes them:

        D/coordinator.key_secret        the coordinator's pair (D/coordinator.key: its public key)
        D/workers/worker.key_secret     every worker's pair
        D/clients/client.key_secret     clients' pair (the HTTP front, InferenceClient, LLM joining)
        D/admins/admin.key_secret       the administrator's pair (the launcher; lifecycle commands)

    The coordinator uses coordinator.key_secret and `--authorized-keys D` (the role folders). The directory
    must be readable where each daemon runs (a shared filesystem across nodes) and by no one else. More keys
    of a role: `infer-keygen NAME --role ROLE --dir D`.
    """

    path: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path).expanduser().resolve())
        if not self.path.is_dir():
            raise ValueError(
                f"keys directory {self.path} does not exist (make it with `infer-keygen --cluster --dir {self.path}`)"
            )
        if (self.path / "worker.key_secret").exists() and not (self.path / ROLE_FOLDERS[Role.WORKER]).exists():
            raise ValueError(
                f"{self.path} holds a key set from before key roles (worker and client keys side by "
                f"side, either able to act as anything); make a new set with `infer-keygen --cluster "
                f"--dir NEW_DIR`, or move worker.key* into {self.path / 'workers'}/, client.key* into "
                f"{self.path / 'clients'}/ and add an administrator with `infer-keygen admin --role "
                f"admin --dir {self.path}`"
            )
        for name in CLUSTER_KEY_NAMES:
            read_key_pair(self.secret(name))

    @classmethod
    def create(cls, path: PathLike, *, force: bool = False) -> ClusterKeyDir:
        """Write a fresh set (the directories are made 0700)."""
        for name in CLUSTER_KEY_NAMES:
            write_key_pair(cluster_key_dir(path, name), name, force=force)
        return cls(Path(path))

    def public(self, name: str) -> Path:
        return key_paths(cluster_key_dir(self.path, name), name)[0]

    def secret(self, name: str) -> Path:
        return key_paths(cluster_key_dir(self.path, name), name)[1]

    def coordinator_flags(self) -> list[str]:
        return ["--curve-secret-key", str(self.secret("coordinator")), "--authorized-keys", str(self.path)]

    def worker_flags(self) -> list[str]:
        return ["--curve-key", str(self.secret("worker")), "--coordinator-key", str(self.public("coordinator"))]

    def client_options(self, name: str = "client") -> ClientKeyOptions:
        """InferenceClient's keyword options with key pair `name` ("admin": the administrator's)."""
        return {"curve_key": str(self.secret(name)), "coordinator_key": str(self.public("coordinator"))}

    def admin_options(self) -> ClientKeyOptions:
        """InferenceClient's keyword options as the administrator (lifecycle commands allowed)."""
        return self.client_options("admin")


def cluster_key_dir(path: PathLike, name: str) -> Path:
    """Where ClusterKeyDir keeps pair `name`: the coordinator's in `path`, the others in their role folder."""
    role = CLUSTER_KEY_ROLES.get(name)
    return Path(path) if role is None else Path(path) / ROLE_FOLDERS[role]


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
    return bool(infos) and all(ipaddress.ip_address(str(info[4][0]).split("%")[0]).is_loopback for info in infos)


def refuse_open_bind(host: str, *, what: str, remedy: str) -> None:
    """ValueError unless `host` is a loopback address. For a listener with nothing protecting it: `what`
    names it, `remedy` says how to protect it; --trusted-network is always offered as the way out."""
    if not is_loopback(host):
        raise ValueError(
            f"refusing to run {what} on {host}, which is not a loopback address, without "
            f"authentication: {remedy}, {TRUSTED_NETWORK_HINT}"
        )


# ---- infer-keygen ------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="infer-keygen",
        description="Write CurveZMQ key pairs: NAME.key (public: it goes in the coordinator's --authorized-keys "
        "directory, in the folder of its role, or to workers and clients as --coordinator-key) and "
        "NAME.key_secret (secret, mode 0600: it stays with its peer).",
        epilog="A whole cluster's set: infer-keygen --cluster --dir D (D/coordinator.key_secret, "
        "D/workers/worker.key_secret, D/clients/client.key_secret, D/admins/admin.key_secret; infer-serve and the "
        "Slurm launcher take it as --keys-dir D). One more key of a role: infer-keygen NAME --role client --dir D.",
    )
    p.add_argument("names", nargs="*", metavar="NAME", help="key pair name(s)")
    p.add_argument(
        "--dir",
        default=".",
        help="where to write the files (default: the current directory; made with mode 0700 if missing)",
    )
    p.add_argument(
        "--role",
        choices=[r.value for r in Role],
        help="write into the role's folder of DIR (workers/, clients/, admins/): the coordinator's "
        "--authorized-keys DIR lets the key in with that role",
    )
    p.add_argument(
        "--cluster",
        action="store_true",
        help="write a whole cluster's set into DIR: coordinator, workers/worker, clients/client, admins/admin",
    )
    p.add_argument("--force", action="store_true", help="replace existing key files")
    return p


def keygen(names: Iterable[str], directory: PathLike, force: bool, role: Role | None = None) -> list[tuple[Path, Path]]:
    """Write pairs `names` into `directory` (its `role` folder when given), refusing before writing anything
    if a file exists (unless `force`)."""
    target = Path(directory) if role is None else Path(directory) / ROLE_FOLDERS[role]
    return _write_all([(target, _check_name(n)) for n in names], force)


def keygen_cluster(directory: PathLike, force: bool) -> list[tuple[Path, Path]]:
    """A whole cluster's set in ClusterKeyDir's layout."""
    return _write_all([(cluster_key_dir(directory, name), name) for name in CLUSTER_KEY_NAMES], force)


def _write_all(pairs: list[tuple[Path, str]], force: bool) -> list[tuple[Path, Path]]:
    if not force:  # refuse before writing anything
        for directory, name in pairs:
            for path in key_paths(directory, name):
                if path.exists():
                    raise FileExistsError(f"{path} exists: refusing to overwrite it (--force replaces it)")
    return [write_key_pair(directory, name, force=force) for directory, name in pairs]


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.names and not args.cluster:
        parser.error("give key pair NAME(s), or --cluster for a whole cluster's set")
    try:
        written = keygen_cluster(args.dir, args.force) if args.cluster else []
        written += keygen(args.names, args.dir, args.force, Role(args.role) if args.role else None)
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
