"""A dead coordinator's shard, handed over to the coordinator that took it.

Why: a worker shared by coordinator shards keeps one link per coordinator ADDRESS
(`hexgen_worker.shards`). When the coordinator holding shard S dies, a spare at another
address takes S's lease and resumes S from Redis (`hexgen_coordinator.shards`): each call
Redis says was dispatched waits ``--resume-grace-s`` for the worker that holds it to reclaim
it (list it in its hello), and is dispatched again otherwise. But the worker holds those
calls under its link to the dead coordinator, which never comes back, while its link to the
spare says hello with nothing: without a hand-over the spare runs again every call of S
that was running (the work is lost, the queries are late), and the results of S's calls
that finished unacknowledged are never delivered.

So when a link's welcome names shard S (``WorkerWelcome.shard``, the shard's Redis prefix)
and another link whose latest welcome named S is down, that link's calls, queued or running
(untouched in the queue and the engine), and its unacknowledged results become the new
link's (`WorkerState.move_calls`); the new link then says hello again listing them, as a
reconnecting worker does (`CoordinatorLink` drops the stream that was welcomed and reopens
it at once, before it reads anything else from it), and sends the results on it. The
coordinator reclaims the calls and takes the results (`hexgen_coordinator.recovery`).

What keeps it correct:

- **Only a down link's calls move.** A lease lets one coordinator hold S at a time; a
  live link whose welcome named S is that of a coordinator about to stop (it lost the
  lease), so nothing moves then, and its calls take the ordinary path (dispatched again).
  A link that comes back later serving S again (after the new holder died in turn) takes
  the calls back the same way; serving another shard, it holds nothing of S.
- **Ids.** A moved call keeps its engine id; `ShardMap.hand_over` records it for the new
  (link, call id), and a call of the same id dispatched later on the old link gets a fresh
  one (`ShardMap.engine_id`). A call the new link already holds under the same id (its
  coordinator dispatched it again first) stays, and the old copy goes: the new coordinator
  waits for its own attempt.
- **Clocks.** The shard's epoch lives in Redis under its prefix, so the new holder's clock
  is the old one's. The worker holds every time on its local clock and translates each
  report to the clock of the link that sends it (`ShardMap.to_link`), so a different epoch
  (the shard's keys were wiped and it began again) would still read right; it is logged,
  and that coordinator drops the calls it does not know (``WorkerWelcome.drop_call_ids``).
- **Slots.** A coordinator reclaims a call only on the slot Redis placed it on. A worker
  with ``--slot`` holds the same slot at every coordinator; one given different slots keeps
  the new holder's (asking for another could take a slot from another worker), and the
  calls are dropped and dispatched again, as without a hand-over (logged).
"""

from __future__ import annotations

import logging

from hexgen_worker.shards import ShardMap
from hexgen_worker.state import WorkerState

__all__ = ["hand_over_shard", "lost_holders"]

log = logging.getLogger("hexgen_worker.worker")  # the worker's one logger


def lost_holders(shards: ShardMap, link: int) -> list[int]:
    """The down links whose latest welcome named the shard link `link`'s latest names."""
    settings = shards.settings[link]
    if settings is None or not settings.shard:
        return []  # not sharded: no shard to match
    return [
        other
        for other, theirs in enumerate(shards.settings)
        if other != link
        and theirs is not None
        and theirs.shard == settings.shard
        and not shards.up[other]
    ]


def hand_over_shard(state: WorkerState, link: int) -> int:
    """Link `link` was just welcomed: move to it what every lost holder of its shard holds
    (see the module docstring). Returns how many calls and results moved (0: nothing, the
    link need not say hello again)."""
    shards = state.shards
    settings = shards.settings[link]
    moved = 0
    for source in lost_holders(shards, link):
        theirs = shards.settings[source]
        assert settings is not None and theirs is not None  # both named the shard
        calls, results = state.move_calls(source, link)
        if not calls + results:
            continue
        moved += calls + results
        log.info(
            "shard %s moved from coordinator %s to %s: handing over %d calls and %d results",
            settings.shard,
            shards.names[source],
            shards.names[link],
            calls,
            results,
        )
        if theirs.clock != settings.clock:
            log.warning(
                "shard %s: coordinator %s's clock %s is not %s's %s (the shard began again?); "
                "the handed-over calls' times are translated to it",
                settings.shard,
                shards.names[link],
                settings.clock,
                shards.names[source],
                theirs.clock,
            )
        if theirs.slot != settings.slot:
            log.warning(
                "shard %s: this worker held slot %d at coordinator %s and holds %d at %s, "
                "which will not reclaim the handed-over calls (start workers with --slot)",
                settings.shard,
                theirs.slot,
                shards.names[source],
                settings.slot,
                shards.names[link],
            )
    return moved
