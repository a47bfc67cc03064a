"""A scripted end of sequence: how many tokens each call's model writes before it stops.

A real agent's call declares a cap (its ``max_tokens``) and the model stops at its
end-of-sequence token, usually well before; nothing ahead of the engine knows where. The
workers' real engines generate exactly what they are asked (vLLM's ``ignore_eos``), so that
a call costs what was declared. A replay that wants each call to stop where a trace
recorded it, while the coordinator sees only the caps, gives every worker an EOS script
(``--eos-script FILE``): a JSON object of call id (the coordinator's, ``QUERY/STAGE.INDEX``)
to the tokens the model writes. The worker asks its engine for that many, never more than
the call's cap; a call the script does not name runs to its cap. The coordinator sees the
cap at submission and the tokens generated when the call finishes, as it would from a
model that stopped by itself.

It stands in for the model's own stopping where that cannot be had: SmolLM2 on the
replays' synthetic prompts does not stop where the recorded agentic calls did
(benchmarks/real_engine_hetero.py ``--output-lengths learned``). It is read once, when the
worker starts; it holds only counts, no prompt.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from hexgen_flow.errors import ConfigError

__all__ = ["EosScript"]


class EosScript:
    """Each named call's output tokens before its end of sequence (module docstring)."""

    def __init__(self, tokens: Mapping[str, int]) -> None:
        for call_id, count in tokens.items():
            if type(count) is not int or count < 1:
                raise ConfigError(
                    f"{call_id!r}: output tokens must be an integer >= 1, got {count!r}"
                )
        self._tokens = dict(tokens)

    def __len__(self) -> int:
        return len(self._tokens)

    def tokens(self, call_id: str, cap: int) -> int:
        """What the engine is asked for: the call's scripted tokens, at most its `cap`."""
        return min(cap, self._tokens.get(call_id, cap))

    @classmethod
    def read(cls, path: str | Path) -> EosScript:
        """The script in the JSON file `path` (`ConfigError` naming the file and what is
        wrong with it)."""
        try:
            doc = json.loads(Path(path).read_text(encoding="utf-8"))
        except OSError as exc:
            raise ConfigError(f"--eos-script {path}: {exc.strerror}") from None
        except ValueError as exc:
            raise ConfigError(f"--eos-script {path}: not JSON ({exc})") from None
        if not isinstance(doc, dict):
            raise ConfigError(f"--eos-script {path}: expected a JSON object of call id to tokens")
        try:
            return cls(doc)
        except ConfigError as exc:
            raise ConfigError(f"--eos-script {path}: {exc}") from None

    def write(self, path: str | Path) -> None:
        """Keep the script as `read` takes it."""
        Path(path).write_text(json.dumps(self._tokens, sort_keys=True), encoding="utf-8")
