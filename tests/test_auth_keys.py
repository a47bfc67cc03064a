"""The pieces of a secured mesh on their own: the keys file, protected mode, the auth
directory, a tenant's rate bucket. (`test_security.py` attacks them assembled.)"""

from __future__ import annotations

import json
import stat
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from hexgen_coordinator.admission import TokenBucket
from hexgen_flow.errors import ConfigError
from hexgen_service.auth import AuthError, KeyStore, Role, TenantLimits
from hexgen_service.auth_dir import AuthDir
from hexgen_service.exposure import is_loopback, refuse_unprotected


def _unauthenticated(store: KeyStore, key: str | None) -> str:
    with pytest.raises(AuthError) as caught:
        store.authenticate(key)
    assert caught.value.code == grpc.StatusCode.UNAUTHENTICATED
    return str(caught.value)


def test_a_key_is_stored_as_its_hash_and_names_its_tenant_and_role(tmp_path: Path) -> None:
    store = KeyStore.create(tmp_path / "keys.json")
    key, record = store.add("acme", Role.OPERATOR)
    text = (tmp_path / "keys.json").read_text()
    assert key not in text and key.split("_", 2)[2] not in text  # the secret may hold "_"
    assert stat.S_IMODE((tmp_path / "keys.json").stat().st_mode) == 0o600
    principal = KeyStore(tmp_path / "keys.json").authenticate(key)
    assert (principal.key_id, principal.tenant, principal.role) == (
        record.key_id, "acme", Role.OPERATOR)  # fmt: skip
    assert principal.sees("someone-else") and principal.may(Role.OPERATOR)
    assert not principal.may(Role.ADMIN)


def test_every_bad_key_is_refused_with_its_reason(tmp_path: Path) -> None:
    store = KeyStore.create(tmp_path / "keys.json")
    key, record = store.add("acme", Role.TENANT)
    assert "no API key" in _unauthenticated(store, None)
    assert "malformed" in _unauthenticated(store, "hunter2")
    assert "unknown" in _unauthenticated(store, key[:-1] + ("A" if key[-1] != "A" else "B"))
    other = KeyStore.create(tmp_path / "other.json")
    foreign, _ = other.add("acme", Role.TENANT)
    assert "unknown" in _unauthenticated(store, foreign)
    old, _ = store.add("acme", Role.TENANT, expires_s=time.time() - 1)
    assert "expired" in _unauthenticated(store, old)
    store.revoke(record.key_id)
    assert f"{record.key_id} is revoked" in _unauthenticated(store, key)


def test_a_running_store_reads_a_change_of_the_file_within_a_second(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    running = KeyStore.create(path)
    key, record = KeyStore(path).add("acme", Role.TENANT)  # another process mints it
    deadline = time.monotonic() + 2
    while True:
        try:
            running.authenticate(key)
            break
        except AuthError:
            assert time.monotonic() < deadline, "the new key was not read"
            time.sleep(0.05)
    KeyStore(path).revoke(record.key_id)
    time.sleep(1.1)
    assert "revoked" in _unauthenticated(running, key)
    path.write_text("{ not json")  # a half-edited file keeps the keys read before
    time.sleep(1.1)
    assert "revoked" in _unauthenticated(running, key)


def test_a_bad_keys_file_is_refused_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--api-keys-file: cannot read"):
        KeyStore(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"keys": [{"key_id": "x", "tenant": "a", "role": "boss",
                                         "sha256": "0", "created_s": 0}]}))  # fmt: skip
    with pytest.raises(ConfigError, match=r"keys\[0\]: role: 'boss' is not one of"):
        KeyStore(bad)


def test_tenant_limits_are_kept_with_the_keys(tmp_path: Path) -> None:
    store = KeyStore.create(tmp_path / "keys.json")
    store.set_limits("acme", TenantLimits(max_running=3, rate_qps=0.5, burst=2))
    assert KeyStore(tmp_path / "keys.json").limits("acme") == TenantLimits(3, 0.5, 2)
    assert store.limits("nobody") == TenantLimits()
    with pytest.raises(ConfigError, match="must be >= 0"):
        store.set_limits("acme", TenantLimits(max_running=-1))
    quotas = TenantLimits(max_work_s=120.0, max_prompt_bytes=8 << 20, weight=3.0)
    store.set_limits("quota", quotas)
    assert KeyStore(tmp_path / "keys.json").limits("quota") == quotas
    for bad in (TenantLimits(weight=float("nan")), TenantLimits(max_work_s=float("inf"))):
        with pytest.raises(ConfigError, match="must be >= 0 and finite"):
            store.set_limits("quota", bad)


def test_a_token_bucket_lets_a_burst_through_then_the_rate() -> None:
    bucket = TokenBucket(rate=2.0, burst=3)
    assert [bucket.take(10.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert bucket.take(10.0) == pytest.approx(0.5)
    assert bucket.take(10.5) == 0.0  # one token came back in 0.5 s
    assert bucket.take(100.0) == 0.0 and bucket.tokens == pytest.approx(2.0)  # capped at 3


@pytest.mark.parametrize(
    ("address", "loopback"),
    [("127.0.0.1:1", True), ("127.9.9.9:1", True), ("localhost:1", True), ("[::1]:1", True),
     ("0.0.0.0:1", False), ("[::]:1", False), ("10.0.0.5:1", False), ("coordinator:1", False)],
)  # fmt: skip
def test_protected_mode_refuses_an_open_door_beyond_loopback(address: str, loopback: bool) -> None:
    assert is_loopback(address) is loopback
    refuse_unprotected("--listen", address, protected=True, insecure=False, needs="keys")
    refuse_unprotected("--listen", address, protected=False, insecure=True, needs="keys")
    if loopback:
        refuse_unprotected("--listen", address, protected=False, insecure=False, needs="keys")
    else:
        with pytest.raises(ConfigError, match=r"--listen: refusing to listen on .* without keys"):
            refuse_unprotected("--listen", address, protected=False, insecure=False, needs="keys")


def test_an_auth_dir_is_completed_never_overwritten(tmp_path: Path) -> None:
    auth = AuthDir(tmp_path / "auth")
    first = auth.init(["a"])
    assert stat.S_IMODE(auth.path.stat().st_mode) == 0o700
    for private in (auth.ca_key, auth.server_key, auth.worker_key, auth.admin_key,
                    auth.tenant_key("a"), auth.worker_token, auth.keys):  # fmt: skip
        assert private in first or private == auth.keys
        assert stat.S_IMODE(private.stat().st_mode) == 0o600, private
    ca, a_key = auth.ca.read_bytes(), auth.tenant_key("a").read_text()
    second = auth.init(["a", "b"])
    assert auth.tenant_key("b") in second and auth.tenant_key("a") not in second
    assert (auth.ca.read_bytes(), auth.tenant_key("a").read_text()) == (ca, a_key)
    store = KeyStore(auth.keys)
    assert store.authenticate(a_key.strip()).tenant == "a"
    assert store.authenticate(auth.admin_key.read_text().strip()).role == Role.ADMIN
    assert store.authenticate(auth.tuner_key.read_text().strip()).role == Role.OPERATOR
    with pytest.raises(ConfigError, match=r"--tenants: .\.\./x. is not a usable tenant name"):
        auth.init(["../x"])


def test_init_again_with_shards_keeps_the_passwords_and_gives_the_users_every_shard(
    tmp_path: Path,
) -> None:
    auth = AuthDir(tmp_path / "auth")
    auth.init()
    passwords = {u: auth.redis_password(u).read_text() for u in ("coordinator", "tuner")}
    assert " ~hf:* " in auth.redis_acl.read_text()
    written = auth.init(shards=("hf:{s0}:", "hf:{s1}:"))
    assert written == [auth.redis_acl]  # the ACL alone, redone
    assert {u: auth.redis_password(u).read_text() for u in passwords} == passwords
    coordinator, tuner = auth.redis_acl.read_text().splitlines()[:2]
    assert " ~hf:{s0}:* ~hf:{s1}:* resetchannels " in coordinator
    assert " %R~hf:{s1}:finished ~hf:tuner:* resetchannels " in tuner
    assert tuner.endswith(" (%R~hf:{s0}:meta %R~hf:{s1}:meta +hmget)")


@pytest.mark.parametrize(
    ("shards", "error"),
    [
        ("hf:{s0}:,hf:{s0}:", "--shards: a prefix appears twice in ['hf:{s0}:', 'hf:{s0}:']"),
        (",", "argument --shards: expected P0[,P1...]"),
    ],
)
def test_auth_init_refuses_bad_shards_naming_the_flag_and_writes_nothing(
    shards: str, error: str, tmp_path: Path
) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "hexgen_cli", "auth", "init", str(tmp_path / "auth"),
         "--shards", shards],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2 and error in done.stderr, done.stderr
    assert not (tmp_path / "auth").exists()
