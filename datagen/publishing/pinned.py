"""What a run's published bytes depend on besides its content (its first attempt's run id and time), fixed once.

The dataset card names the flow run that made the data and when. Taken from each attempt, they made a re-run
publish a README.md different from the one the interrupted attempt had claimed, and the namespace could never be
finished (issue 24). The first attempt writes them to the run's work dir; every later attempt reads them back,
so every published object is a pure function of the run's content and these facts.
"""

from __future__ import annotations

import os
from datetime import UTC, datetime
from pathlib import Path

from pydantic import BaseModel, Field, ValidationError

__all__ = ["PinnedFacts", "pin_facts"]


class PinnedFacts(BaseModel):
    """The first attempt's facts, as the dataset card and manifest record them."""

    run_id: str | None = Field(None, description="Prefect flow run id of the run's first attempt.")
    run_name: str | None = Field(None, description="Prefect flow run name of the run's first attempt.")
    created_at: str = Field(..., description="ISO timestamp (UTC, seconds) of the first attempt's finish.")


def pin_facts(path: Path, run_id: str | None, run_name: str | None = None) -> PinnedFacts:
    """The facts stored at `path`, or these (run_id, run_name, now) written there first if there are none yet."""
    if path.exists():
        try:
            return PinnedFacts.model_validate_json(path.read_bytes())
        except ValidationError as exc:
            raise ValueError(
                f"{path} is not a pinned-facts file ({exc.error_count()} errors); it fixes the dataset card of "
                "this run's namespace: restore it, or publish under a new namespace"
            ) from None
    facts = PinnedFacts(run_id=run_id, run_name=run_name, created_at=datetime.now(UTC).isoformat(timespec="seconds"))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(facts.model_dump_json(indent=1) + "\n")
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)  # atomic: a kill leaves the old state (no file) or the whole file
    return facts
