"""``policies``: the policy presets and the registered dispatch, queue and budget policies."""

from __future__ import annotations

import argparse
from typing import Any

from hexgen_cli.options import print_json
from hexgen_flow.policies.presets import PRESETS
from hexgen_flow.policies.registration import BUDGETS, DISPATCHERS, QUEUES
from hexgen_flow.policies.registry import Registry

__all__ = ["register"]


def register(commands: Any) -> None:
    """Add ``policies`` to the command parser."""
    pol = commands.add_parser(
        "policies",
        help="list presets and registered policies",
        description="List the policy presets and the registered dispatch, queue and "
        "stage-budget policies with their parameters.",
    )
    pol.add_argument("--json", action="store_true", help="print one JSON object")
    pol.set_defaults(handler=_cmd_policies)


def _registry_json(registry: Registry[Any]) -> dict[str, Any]:
    return {
        name: {
            "description": _first_line(registry.doc(name)),
            "parameters": {k: _jsonable(v) for k, v in registry.parameters(name).items()},
        }
        for name in registry.names()
    }


def _first_line(doc: str | None) -> str:
    lines = (doc or "").strip().splitlines()
    return lines[0].rstrip(":") if lines else ""


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return repr(value)


def _cmd_policies(args: argparse.Namespace) -> int:
    families = (("dispatch", DISPATCHERS), ("queue", QUEUES), ("budget", BUDGETS))
    if args.json:
        print_json(
            {
                "presets": {
                    p.name: {
                        "description": p.description,
                        "dispatch": {"name": p.dispatch.name, "params": dict(p.dispatch.params)},
                        "queue": {"name": p.queue.name, "params": dict(p.queue.params)},
                        "budget": {"name": p.budget.name, "params": dict(p.budget.params)},
                        "has_alpha": p.has_alpha,
                    }
                    for p in PRESETS.values()
                },
                **{family: _registry_json(reg) for family, reg in families},
            }
        )
        return 0
    print("Presets (--policy NAME):")
    width = max(len(name) for name in PRESETS)
    for p in PRESETS.values():
        parts = [
            _ref(p.dispatch.name, p.dispatch.params),
            _ref(p.queue.name, p.queue.params),
            _ref(p.budget.name, p.budget.params),
        ]
        print(f"  {p.name:<{width}}  {p.description}")
        print(f"  {'':<{width}}  = {' + '.join(parts)}{'  [alpha]' if p.has_alpha else ''}")
    print()
    print("Or combine registered policies with their defaults: --policy DISPATCH+QUEUE[+BUDGET]")
    for family, registry in families:
        print()
        print(f"{family} policies:")
        names = registry.names()
        nwidth = max(len(n) for n in names)
        for name in names:
            params = registry.parameters(name)
            shown = ", ".join(f"{k}={v!r}" for k, v in params.items()) or "no parameters"
            print(f"  {name:<{nwidth}}  {_first_line(registry.doc(name))}")
            print(f"  {'':<{nwidth}}  ({shown})")
    return 0


def _ref(name: str, params: Any) -> str:
    if not params:
        return name
    return f"{name}({', '.join(f'{k}={v!r}' for k, v in params.items())})"
