"""Named workflow templates: the stages a workflow session expects before its calls arrive.

A client that opens a workflow session (the coordinator's OpenWorkflow, or the gateway's
``X-Hexgen-Template`` header) names the shape of what it will run, so the stage budgets
can split the SLO over the stages still ahead from the first call on. The calls then
arrive one by one; a stage the client never uses is skipped, one it uses more than
expected grows. A template's token sizes are expectations (the estimator's typical CHESS
sizes, docs/algorithm.md §1), not limits.
"""

from __future__ import annotations

from dataclasses import dataclass

from hexgen_flow.estimate import REPRESENTATIVE_TOKENS

__all__ = ["TEMPLATES", "TemplateStage", "template"]


@dataclass(frozen=True, slots=True)
class TemplateStage:
    name: str
    """What a call names to join the stage (its id in the workflow)."""
    step: str
    calls: int
    """Expected parallel calls."""
    after: tuple[str, ...] = ()
    repeat: int = 1
    """Expected rounds (a loop such as self-correction); each waits for the one before."""

    @property
    def tokens(self) -> tuple[int, int]:
        return REPRESENTATIVE_TOKENS.get(self.step, (1000, 100))


TEMPLATES: dict[str, tuple[TemplateStage, ...]] = {
    # CHESS as this project's Text-to-SQL agent runs it (docs/text-to-sql.md): keywords,
    # schema linking, three SQL candidates, up to two revise rounds, a final evaluation.
    "chess": (
        TemplateStage("extract_keywords", "extract_keywords", 1),
        TemplateStage("information_retriever", "information_retriever", 1, ("extract_keywords",)),
        TemplateStage("generate_candidate", "generate_candidate", 3, ("information_retriever",)),
        TemplateStage("revise", "revise", 3, ("generate_candidate",), repeat=2),
        TemplateStage("evaluate", "evaluate", 1, ("revise",)),
    ),
    # One call: what a request without a template expects (more stages are added as named).
    "single": (TemplateStage("chat", "chat", 1),),
}


def template(name: str) -> tuple[TemplateStage, ...]:
    """The stages of a named template; KeyError names the known ones."""
    try:
        return TEMPLATES[name]
    except KeyError:
        known = ", ".join(sorted(TEMPLATES))
        raise KeyError(f"no template {name!r} (known: {known})") from None
