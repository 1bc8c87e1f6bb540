"""A load's request: what each rank asks of it (a step or the newest, the world-size policy, the
entries of its `state`), checked on rank 0 against every other rank's in the exchange that also
chooses the step (coord.run_decided), so ranks asking for different loads get the same error."""

from __future__ import annotations

from typing import Any, Callable

from distckpt.errors import ConfigError, DistCkptError, RankDisagreementError
from distckpt.protocol.coord import Coordinator, run_decided
from distckpt.state.capture import Entry


def load_request(step: int | None, world_size_policy: str, entries: list[Entry]) -> dict[str, Any]:
    """What this rank asks of a load, checked against every other rank's (check_requests)."""
    return {"step": step, "policy": world_size_policy, "keys": sorted(e.key for e in entries)}


def agree_on_the_request(coord: Coordinator, request: dict[str, Any],
                          then: Callable[[], dict[str, Any]] | None = None) -> dict[str, Any]:
    """Every rank asked for the same load (check_requests), and rank 0's answer to it: `then`,
    run on rank 0 once the requests agree (choosing the step), in the same exchange. One
    exchange: the requests travel to rank 0 alone, and one answer comes back (coord.run_decided)."""
    def decide(asked: list[dict[str, Any]]) -> dict[str, Any]:
        check_requests(asked)
        return then() if then is not None else {}

    return run_decided(coord, "load/request", "choosing a checkpoint to load", request, decide)


def check_requests(asked: list[dict[str, Any]]) -> None:
    """Rank 0 alone chooses the step, so a rank calling load(state, 1) while rank 0 calls
    load(state, 2) or load_latest was silently given step 2. And into states of the same entries,
    as a save requires: a rank whose `state` lacked an entry the others restore (its scheduler)
    went on with its own, with a warning on that rank only. The error names the ranks: every
    rank raises it as it is."""
    refused = [(rank, a["refused"]) for rank, a in enumerate(asked) if "refused" in a]
    error: DistCkptError | None = None
    if refused:
        error = ConfigError("the load was refused on rank(s) " + "; ".join(f"rank {r}: {m}" for r, m in refused))
    elif any((a["step"], a["policy"]) != (asked[0]["step"], asked[0]["policy"]) for a in asked):
        table = ", ".join(f"rank {r}: " + ("load_latest" if a["step"] is None else f"load(state, {a['step']})")
                          + f" with world_size_policy={a['policy']!r}" for r, a in enumerate(asked))
        error = RankDisagreementError(f"the ranks asked for different loads — {table}; every rank must load the "
                                      "same step (or every rank load_latest) with the same manager settings")
    elif any(a["keys"] != asked[0]["keys"] for a in asked):
        table = "; ".join(f"rank {r}: {a['keys']}" for r, a in enumerate(asked))
        error = RankDisagreementError(f"the ranks load into states of different entries — {table}; every rank "
                                      "must pass a `state` with the same keys (wrap what differs in per_rank(...))")
    if error is not None:
        error.names_ranks = True  # type: ignore[attr-defined]  # said as it is on every rank (coord.Outcome.failure)
        raise error


def refuse_load_request(coord: Coordinator, error: ConfigError) -> None:
    """This rank's load arguments were refused: every rank, in the request's exchange, raises the
    same ConfigError naming it (this rank included)."""
    agree_on_the_request(coord, {"refused": str(error)})
