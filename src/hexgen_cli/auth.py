"""``auth``: make and manage a secured mesh's credentials (CA, certificates, API keys).

hexgen-flow auth init DIR [--tenants a,b] [--hosts NAME,...] [--redis-prefix P]
                         [--shards P0,P1,...]
hexgen-flow auth add-key DIR --tenant T [--role tenant|operator|admin] [--expires-in-days N]
hexgen-flow auth revoke DIR KEY_ID
hexgen-flow auth list DIR [--json]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from hexgen_cli.options import PROG, info, positive_float, print_json, print_rows

__all__ = ["name_list", "register", "shard_list"]


def name_list(text: str) -> tuple[str, ...]:
    """``--tenants a,b`` or ``--hosts x,y``: the names, in order, without repeats."""
    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    if not names:
        raise argparse.ArgumentTypeError("expected NAME[,NAME...]")
    return names


def shard_list(text: str) -> tuple[str, ...]:
    """``--shards P0,P1,...``, split as the coordinators split theirs (empty items dropped);
    `AuthDir.init` checks the prefixes (`hexgen_service.auth_dir.shard_prefixes`)."""
    prefixes = tuple(p.strip() for p in text.split(",") if p.strip())
    if not prefixes:
        raise argparse.ArgumentTypeError("expected P0[,P1...]: every shard's key prefix")
    return prefixes


def register(commands: Any) -> None:
    """Add ``auth`` and its subcommands to the command parser."""
    auth = commands.add_parser(
        "auth",
        help="make a secured mesh's credentials: local CA, certificates, API keys",
        description="Make and manage the credentials of a secured mesh in one directory "
        "(docs/security.md): a local CA, the services' and workers' certificates, API keys "
        "(stored hashed in DIR/keys.json; each key is shown once, in its own 0600 file), the "
        "workers' token and the Redis ACL users.",
    )
    sub = auth.add_subparsers(dest="auth_command", metavar="SUBCOMMAND", required=True)
    init = sub.add_parser(
        "init",
        help="create DIR's credentials (existing files are kept)",
        description="Create the credentials directory, or complete it: files that exist are "
        "kept, so running it again only adds what is missing (e.g. new tenants' keys).",
    )
    init.add_argument("dir", type=Path, metavar="DIR")
    init.add_argument(
        "--tenants", type=name_list, default=(), metavar="NAME[,NAME...]",
        help="make a key for each tenant: DIR/tenants/NAME.key",
    )  # fmt: skip
    init.add_argument(
        "--hosts", type=name_list, default=(), metavar="NAME[,NAME...]",
        help="more names or addresses the server certificate is valid for (it always is "
        "for localhost, 127.0.0.1, ::1, coordinator, tuner and gateway)",
    )  # fmt: skip
    init.add_argument(
        "--redis-prefix", default="hf:", metavar="PREFIX",
        help="the Redis key prefix (default hf:); with --shards, the tuner's own (its "
        "--redis-prefix: its runs and run counter under PREFIXtuner:*)",
    )  # fmt: skip
    init.add_argument(
        "--shards", type=shard_list, default=(), metavar="P0,P1,...",
        help="a sharded mesh's Redis ACL: every shard's key prefix, as the coordinators' "
        "--shards lists them; the coordinator user gets every shard's keys (a spare takes "
        "over any shard), the tuner reads every shard's admitted, finished and meta keys",
    )  # fmt: skip
    init.set_defaults(handler=_cmd_init)

    add = sub.add_parser("add-key", help="mint an API key", description="Mint an API key "
                         "for a tenant with a role; it is written to --out (mode 0600) or "
                         "printed once, and only its hash is kept.")  # fmt: skip
    add.add_argument("dir", type=Path, metavar="DIR")
    add.add_argument("--tenant", required=True)
    add.add_argument("--role", choices=("tenant", "operator", "admin"), default="tenant")
    add.add_argument("--expires-in-days", type=positive_float, default=None, metavar="DAYS")
    add.add_argument("--out", type=Path, default=None, metavar="FILE")
    add.set_defaults(handler=_cmd_add)

    revoke = sub.add_parser(
        "revoke",
        help="revoke an API key",
        description="Mark a key revoked; running services refuse it within a second.",
    )
    revoke.add_argument("dir", type=Path, metavar="DIR")
    revoke.add_argument("key_id", metavar="KEY_ID", help="the 12 hex digits after hfk_")
    revoke.set_defaults(handler=_cmd_revoke)

    limits = sub.add_parser(
        "limits",
        help="set a tenant's own admission limits",
        description="Give a tenant its own limits, checked at admission like every other "
        "(RESOURCE_EXHAUSTED with a retry-after hint): queries running at once (over the "
        "coordinator's --max-tenant-queries), a submission rate with a burst, work in "
        "flight, prompt bytes kept, and its weight in fair admission. 0 lifts a limit. "
        "Running services read the change within a second.",
    )
    limits.add_argument("dir", type=Path, metavar="DIR")
    limits.add_argument("--tenant", required=True)
    limits.add_argument("--max-running", type=int, default=0, metavar="N")
    limits.add_argument("--rate-qps", type=float, default=0.0, metavar="QPS")
    limits.add_argument("--burst", type=int, default=0, metavar="N",
                        help="submissions allowed at once above the rate (default: the rate, "
                        "at least 1)")  # fmt: skip
    limits.add_argument("--max-work-s", type=float, default=0.0, metavar="S",
                        help="work the tenant may have in flight: its running calls, in "
                        "seconds of saturated work in the scheduler's estimates")  # fmt: skip
    limits.add_argument("--max-prompt-bytes", type=int, default=0, metavar="BYTES",
                        help="prompt bytes it may keep in running calls (default: the "
                        "coordinator's --max-tenant-prompt-bytes)")  # fmt: skip
    limits.add_argument("--weight", type=float, default=0.0, metavar="W",
                        help="its weight in fair admission: while tenants compete, another "
                        "tenant's work counts against its queries only up to that tenant's "
                        "share, weight / the weights' sum (default 1)")  # fmt: skip
    limits.set_defaults(handler=_cmd_limits)

    lst = sub.add_parser("list", help="list the API keys (ids, tenants, roles, state)")
    lst.add_argument("dir", type=Path, metavar="DIR")
    lst.add_argument("--json", action="store_true", help="one JSON object")
    lst.set_defaults(handler=_cmd_list)


def _auth_dir(path: Path) -> Any:
    from hexgen_launch.security import AuthDir  # noqa: PLC0415 - loads cryptography

    return AuthDir(path)


def _cmd_init(args: argparse.Namespace) -> int:
    auth = _auth_dir(args.dir)
    written = auth.init(
        args.tenants,
        server_names=args.hosts,
        redis_prefix=args.redis_prefix,
        shards=args.shards,
    )
    info(f"{PROG}: {len(written)} files written in {args.dir}")
    print_rows(usage_rows(auth, args.tenants))
    return 0


def usage_rows(auth: Any, tenants: tuple[str, ...]) -> list[tuple[str, str]]:
    """How to use an auth directory's files: the rows `auth init` and `up --secure` print."""
    first = tenants[0] if tenants else "NAME"
    return [
        ("CA (clients trust it)", f"export HEXGEN_FLOW_TLS_CA={auth.ca}"),
        ("admin key", str(auth.admin_key)),
        ("tenant keys", ", ".join(str(auth.tenant_key(t)) for t in tenants) or "none"),
        ("as a tenant", f"export HEXGEN_FLOW_API_KEY=$(cat {auth.tenant_key(first)})"),
        ("keys (hashed)", f"{auth.keys}: the services' --api-keys-file"),
        ("worker credentials", f"{auth.worker_cert}, {auth.worker_key}, {auth.worker_token}"),
    ]


def _cmd_add(args: argparse.Namespace) -> int:
    from hexgen_launch.security import (  # noqa: PLC0415
        KeyStore,
        Role,
        write_private,
    )

    store = KeyStore(_auth_dir(args.dir).keys)
    expires = time.time() + args.expires_in_days * 86_400 if args.expires_in_days else 0.0
    key, record = store.add(args.tenant, Role.parse(args.role), expires_s=expires)
    if args.out is not None:
        write_private(args.out, (key + "\n").encode())
        info(f"{PROG}: key {record.key_id} ({record.role} of {record.tenant!r}) in {args.out}")
    else:
        info(f"{PROG}: key {record.key_id} ({record.role} of {record.tenant!r}); shown once:")
        print(key)
    return 0


def _cmd_revoke(args: argparse.Namespace) -> int:
    from hexgen_launch.security import KeyStore  # noqa: PLC0415

    record = KeyStore(_auth_dir(args.dir).keys).revoke(args.key_id)
    info(f"{PROG}: revoked key {record.key_id} ({record.role} of {record.tenant!r})")
    return 0


def _cmd_limits(args: argparse.Namespace) -> int:
    from hexgen_launch.security import KeyStore, TenantLimits  # noqa: PLC0415

    limits = TenantLimits(
        args.max_running,
        args.rate_qps,
        args.burst,
        max_work_s=args.max_work_s,
        max_prompt_bytes=args.max_prompt_bytes,
        weight=args.weight,
    )
    KeyStore(_auth_dir(args.dir).keys).set_limits(args.tenant, limits)
    info(f"{PROG}: tenant {args.tenant!r}: {limits}")
    return 0


def _cmd_list(args: argparse.Namespace) -> int:
    from hexgen_launch.security import KeyStore  # noqa: PLC0415

    now = time.time()
    records = KeyStore(_auth_dir(args.dir).keys).records()

    def state(r: Any) -> str:
        if r.revoked:
            return "revoked"
        if r.expires_s and now >= r.expires_s:
            return "expired"
        return "active"

    if args.json:
        print_json(
            {
                "keys": [
                    {"key_id": r.key_id, "tenant": r.tenant, "role": r.role, "state": state(r),
                     "expires_s": r.expires_s or None, "note": r.note}
                    for r in records
                ]
            }
        )  # fmt: skip
        return 0
    for r in records:
        print(f"{r.key_id}  {r.role:<8}  {state(r):<7}  {r.tenant}  {r.note}")
    return 0
