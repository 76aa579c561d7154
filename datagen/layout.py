"""Where a run keeps its local files: one place that names every path of the data path."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["TARGET_FILE", "RunLayout"]

# In a run's root: the S3 place (endpoint, bucket, prefix) whose namespace the run's files are for.
TARGET_FILE = "s3-target"


@dataclass(frozen=True, slots=True)
class RunLayout:
    """Paths of one run under `<work_dir>/runs/<namespace>/`."""

    root: Path

    @classmethod
    def for_run(cls, work_dir: Path, namespace: str) -> RunLayout:
        """A run's files by its name alone (a pilot, a benchmark: nothing published under it)."""
        return cls(Path(work_dir) / "runs" / namespace)

    @classmethod
    def for_target(cls, work_dir: Path, namespace: str, target: str) -> RunLayout:
        """The files of the run publishing `namespace` at `target` (the S3 endpoint, bucket and prefix): one root
        per (target, namespace), so a namespace of the same name under another prefix never takes this one's
        checkpoints, staged files or first attempt's run id and date (issue 47).

        `runs/<namespace>` belongs to the first target that claims it (`TARGET_FILE`, written here); another
        target's run of that name gets `runs/<namespace>@<hash of its target>`. A root made before targets were
        recorded has no claim: the first run that finds it adopts it (it was made by that name on this box).
        """
        plain = Path(work_dir) / "runs" / namespace
        digest = hashlib.sha256(target.encode("utf-8")).hexdigest()[:12]
        for root in (plain, plain.with_name(f"{namespace}@{digest}")):
            marker = root / TARGET_FILE
            if marker.is_file():
                if marker.read_text(encoding="utf-8").strip() == target:
                    return cls(root)
                continue
            root.mkdir(parents=True, exist_ok=True)
            tmp = marker.with_name(f".{TARGET_FILE}.tmp")
            tmp.write_text(target + "\n", encoding="utf-8")
            os.replace(tmp, marker)
            return cls(root)
        raise RuntimeError(f"{plain}: both {plain.name} and {plain.name}@{digest} belong to other S3 targets")

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
