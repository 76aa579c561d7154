"""Where a run keeps its local files: one place that names every path of the data path."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = ["RunLayout"]


@dataclass(frozen=True, slots=True)
class RunLayout:
    """Paths of one run under `<work_dir>/runs/<namespace>/`."""

    root: Path

    @classmethod
    def for_run(cls, work_dir: Path, namespace: str) -> RunLayout:
        return cls(Path(work_dir) / "runs" / namespace)

    @property
    def shards_dir(self) -> Path:
        """Shard prompt files and generation checkpoints."""
        return self.root / "shards"

    def shard_prompts(self, shard_id: int) -> Path:
        return self.shards_dir / f"shard-{shard_id:05d}.prompts.jsonl"

    def shard_completions(self, shard_id: int) -> Path:
        return self.shards_dir / f"shard-{shard_id:05d}.completions.jsonl"

    def shard_rejects(self, shard_id: int) -> Path:
        return self.shards_dir / f"shard-{shard_id:05d}.rejects.jsonl"

    @property
    def load_rejects(self) -> Path:
        """Rows of the prompt sources that could not be read as prompts."""
        return self.root / "load-rejects.jsonl"

    @property
    def validated_dir(self) -> Path:
        """Accepted completions and validation rejects."""
        return self.root / "validated"

    @property
    def staging_dir(self) -> Path:
        """Exactly what gets published: data/*.parquet, rejects/*.parquet, README.md."""
        return self.root / "dataset"

    @property
    def pinned_facts(self) -> Path:
        """The first attempt's run id and time (datagen.publishing.pinned): every re-attempt publishes the same card."""
        return self.root / "pinned-facts.json"

    @property
    def id_scheme_file(self) -> Path:
        """The prompt id scheme of this work dir (tasks/planning.py `id_scheme`): fixed by its first plan."""
        return self.root / "prompt-id-scheme"

    @property
    def logs_dir(self) -> Path:
        """Server logs of servers this run started."""
        return self.root / "logs"
