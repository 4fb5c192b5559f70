"""protocol/keys.py: key files (written private, never overwritten by accident, read back with a clear error
for every way a file can be wrong), the authorized-key directory (re-read when it changes), a cluster's key
directory, the loopback rule, and infer-keygen's command line."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import zmq

from infer.protocol import keys as K
from infer.protocol.roles import Role


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_key_pair_is_written_private_and_reads_back(tmp_path):
    directory = tmp_path / "new" / "keys"
    public, secret = K.write_key_pair(directory, "worker")
    assert (public.name, secret.name) == ("worker.key", "worker.key_secret")
    assert (_mode(secret), _mode(public), _mode(directory)) == (0o600, 0o644, 0o700)
    pub, sec = K.read_key_pair(secret)
    assert K.read_public_key(public) == pub == zmq.curve_public(sec)
    assert K.read_key_file(public) == (pub, None)
    assert sorted(p.name for p in directory.iterdir()) == ["worker.key", "worker.key_secret"]  # no temp left


def test_existing_key_files_are_never_overwritten_without_force(tmp_path):
    public, secret = K.write_key_pair(tmp_path, "client")
    before = (public.read_bytes(), secret.read_bytes())
    with pytest.raises(FileExistsError, match="refusing to overwrite"):
        K.write_key_pair(tmp_path, "client")
    secret.unlink()  # half a pair left: still refused (the public half would be replaced)
    with pytest.raises(FileExistsError, match=r"client\.key exists"):
        K.write_key_pair(tmp_path, "client")
    assert public.read_bytes() == before[0]
    K.write_key_pair(tmp_path, "client", force=True)
    assert public.read_bytes() != before[0] and _mode(secret) == 0o600


@pytest.mark.parametrize("name", ["", ".hidden", "a/b", "x.key_secret"])
def test_a_key_name_is_a_plain_file_name(tmp_path, name):
    with pytest.raises(ValueError, match="bad key name"):
        K.write_key_pair(tmp_path, name)


def test_every_kind_of_bad_key_file_says_what_is_wrong(tmp_path):
    public, secret = K.write_key_pair(tmp_path, "peer")
    with pytest.raises(ValueError, match="does not exist"):
        K.read_key_pair(tmp_path / "missing.key_secret")
    with pytest.raises(ValueError, match="is a directory"):
        K.read_key_pair(tmp_path)
    with pytest.raises(ValueError, match="holds only a public key; a secret key file"):
        K.read_key_pair(public)
    garbage = tmp_path / "garbage"
    garbage.write_text("hello\n")
    with pytest.raises(ValueError, match="is not a CURVE key file"):
        K.read_key_pair(garbage)
    short = tmp_path / "short.key"
    short.write_text('curve\n    public-key = "abc"\n')
    with pytest.raises(ValueError, match="not a CURVE key: 3 characters"):
        K.read_public_key(short)
    other_public = K.read_public_key(K.write_key_pair(tmp_path, "other")[0])
    edited = tmp_path / "edited.key_secret"
    edited.write_text(secret.read_text().replace(K.read_public_key(public).decode(), other_public.decode()))
    with pytest.raises(ValueError, match="does not belong to its secret key"):
        K.read_key_pair(edited)
    unreadable = tmp_path / "unreadable.key_secret"
    unreadable.write_bytes(secret.read_bytes())
    unreadable.chmod(0)
    if os.geteuid() != 0:  # root reads anything
        with pytest.raises(ValueError, match="cannot read key file"):
            K.read_key_pair(unreadable)


def test_a_secret_file_readable_by_others_is_warned_about(tmp_path, caplog):
    _, secret = K.write_key_pair(tmp_path, "peer")
    secret.chmod(0o644)
    K.read_key_pair(secret)
    assert "readable by others (mode 0644): chmod 600" in caplog.text


def test_client_keys_need_both_files_and_a_server_needs_its_secret(tmp_path):
    _, coordinator_secret = K.write_key_pair(tmp_path, "coordinator")
    _, client_secret = K.write_key_pair(tmp_path, "client")
    assert K.CurveKeys.from_files(None, None) is None
    with pytest.raises(ValueError, match="--curve-key and --coordinator-key go together"):
        K.CurveKeys.from_files(client_secret, None, flags=("--curve-key", "--coordinator-key"))
    keys = K.CurveKeys.from_files(client_secret, tmp_path / "coordinator.key")
    server = K.CurveKeys.server(coordinator_secret)
    assert keys.server_key == server.public_key and server.is_server and not keys.is_server
    assert keys.as_server().server_key is None and keys.towards(b"x" * 40).server_key == b"x" * 40
    with pytest.raises(ValueError, match="holds only a public key"):
        K.CurveKeys.server(tmp_path / "coordinator.key")
    with pytest.raises(ValueError, match="public_key does not belong to secret_key"):
        K.CurveKeys(server.public_key, keys.secret_key)


def test_authorized_keys_are_the_role_folders_public_files_and_follow_them(tmp_path, caplog):
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    with pytest.raises(ValueError, match=r"no public key files \(\*\.key\)"):
        K.AuthorizedKeys.from_options(allowed)
    with pytest.raises(ValueError, match="does not exist or is not a directory"):
        K.AuthorizedKeys.from_options(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="--authorized-keys DIR"):
        K.AuthorizedKeys.from_options()
    w_public, _ = K.write_key_pair(allowed / "workers", "w")  # w.key_secret next to it is never a key
    c_public, _ = K.write_key_pair(allowed / "clients", "c")
    b_public, _ = K.write_key_pair(tmp_path, "b")
    gate = K.AuthorizedKeys.from_options(allowed)
    w, c, b = (K.read_public_key(p) for p in (w_public, c_public, b_public))
    assert gate.keys == {w, c} and gate.allows(w) and gate.allows(c) and not gate.allows(b)
    assert gate.roles_of(w) == {Role.WORKER} and gate.roles_of(c) == {Role.CLIENT} and gate.roles_of(b) == set()
    assert "1 worker key(s)" in gate.describe() and "no admin keys" in gate.describe()
    generation = gate.generation
    (allowed / "admins").mkdir()
    (allowed / "admins" / "b.key").write_bytes(b_public.read_bytes())  # a role folder made later is read
    assert gate.allows(b) and gate.roles_of(b) == {Role.ADMIN}
    generation = gate.generation
    (allowed / "admins" / "c.key").write_bytes(c_public.read_bytes())  # a key in two folders: both roles
    assert gate.refresh() and gate.roles_of(c) == {Role.CLIENT, Role.ADMIN} and gate.generation > generation
    assert not gate.refresh()  # nothing changed since
    w_public.unlink()  # revoked
    assert not gate.allows(w) and gate.roles_of(w) == set() and gate.allows(b)
    (allowed / "clients" / "broken.key").write_text("nonsense")  # a bad file keeps the last good set
    assert gate.allows(c) and "authorized keys not reloaded" in caplog.text


def test_a_flat_authorized_keys_directory_is_refused_saying_where_keys_go(tmp_path):
    K.write_key_pair(tmp_path / "flat", "worker")
    K.write_key_pair(tmp_path / "flat", "client")
    with pytest.raises(
        ValueError,
        match=r"holds public key files directly \(client.key, worker.key\).*"
        r"any key could act as a worker, a client or an administrator.*"
        r"flat/workers/ \(workers\)",
    ):
        K.AuthorizedKeys.from_options(tmp_path / "flat")
    admins = tmp_path / "ops"
    K.write_key_pair(admins, "root")
    gate = K.AuthorizedKeys.from_options(admins=admins, clients=tmp_path / "flat")  # per-role directories
    assert gate.roles_of(K.read_public_key(admins / "root.key")) == {Role.ADMIN}
    assert gate.roles_of(K.read_public_key(tmp_path / "flat" / "worker.key")) == {Role.CLIENT}


def test_a_cluster_key_directory_gives_each_daemon_its_files(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        K.ClusterKeyDir(tmp_path / "none")
    keys = K.ClusterKeyDir.create(tmp_path / "cluster")
    d = keys.path
    assert keys.coordinator_flags() == [
        "--curve-secret-key",
        str(d / "coordinator.key_secret"),
        "--authorized-keys",
        str(d),
    ]
    assert keys.worker_flags() == [
        "--curve-key",
        str(d / "workers" / "worker.key_secret"),
        "--coordinator-key",
        str(d / "coordinator.key"),
    ]
    assert keys.client_options() == {
        "curve_key": str(d / "clients" / "client.key_secret"),
        "coordinator_key": str(d / "coordinator.key"),
    }
    assert keys.admin_options()["curve_key"] == str(d / "admins" / "admin.key_secret")
    gate = K.AuthorizedKeys.from_options(d)
    assert [gate.roles_of(K.read_public_key(keys.public(n))) for n in ("worker", "client", "admin")] == [
        {Role.WORKER},
        {Role.CLIENT},
        {Role.ADMIN},
    ]
    assert gate.roles_of(K.read_public_key(keys.public("coordinator"))) == set()
    (d / "workers" / "worker.key_secret").unlink()
    with pytest.raises(ValueError, match="worker.key_secret does not exist"):
        K.ClusterKeyDir(d)
    for name in ("coordinator", "worker", "client"):  # the set infer-keygen wrote before roles
        K.write_key_pair(tmp_path / "old", name)
    with pytest.raises(ValueError, match="from before key roles.*infer-keygen --cluster"):
        K.ClusterKeyDir(tmp_path / "old")


@pytest.mark.parametrize(
    "host, loopback",
    [
        ("127.0.0.1", True),
        ("127.1.2.3", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("*", False),
        ("::", False),
        ("10.0.0.5", False),
        ("eth0", False),
        ("no-such-host.invalid", False),
    ],
)
def test_only_loopback_addresses_are_loopback(host, loopback):
    assert K.is_loopback(host) is loopback


def test_an_open_bind_is_refused_with_both_ways_out():
    K.refuse_open_bind("127.0.0.1", what="x", remedy="y")
    with pytest.raises(ValueError, match=r"the thing on 0\.0\.0\.0.*pass keys, or --trusted-network"):
        K.refuse_open_bind("0.0.0.0", what="the thing", remedy="pass keys")


def test_keygen_command_line(tmp_path, capsys):
    assert K.main(["--cluster", "--dir", str(tmp_path / "k")]) == 0
    out = capsys.readouterr().out
    assert out.count("public key") == 4 and "clients/client.key_secret (secret, mode 0600)" in out
    K.ClusterKeyDir(tmp_path / "k")
    before = (tmp_path / "k" / "clients" / "client.key_secret").read_bytes()
    assert K.main(["extra", "client", "--role", "client", "--dir", str(tmp_path / "k")]) == 1  # nothing written
    assert "refusing to overwrite" in capsys.readouterr().err
    assert not (tmp_path / "k" / "clients" / "extra.key").exists()
    assert (tmp_path / "k" / "clients" / "client.key_secret").read_bytes() == before
    assert K.main(["client", "--role", "client", "--dir", str(tmp_path / "k"), "--force"]) == 0
    assert (tmp_path / "k" / "clients" / "client.key_secret").read_bytes() != before
    assert K.main(["ops", "--role", "admin", "--dir", str(tmp_path / "k")]) == 0
    assert (tmp_path / "k" / "admins" / "ops.key").exists()
    assert K.main(["../x", "--dir", str(tmp_path)]) == 2
    with pytest.raises(SystemExit):
        K.main(["--dir", str(tmp_path)])  # neither names nor --cluster
