"""Infrastructure settings: where things are and how to reach them (not what a run should do).

Sources, highest priority first: init arguments > environment (`DATAGEN_*`) > `.env` file >
defaults. Secrets are `SecretStr`: they never appear in logs, reprs, flow parameters or task results.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

__all__ = ["Settings"]


class Settings(BaseSettings):
    """Endpoints, credentials and machine facts for one box; read from the environment."""

    model_config = SettingsConfigDict(env_prefix="DATAGEN_", env_file=".env", extra="ignore")

    # --- S3 -------------------------------------------------------------------------------
    s3_endpoint_url: str | None = Field(
        None, description="S3 endpoint URL; None means AWS's default endpoint for the region."
    )
    s3_bucket: str = Field("datagen", description="Bucket that receives published datasets.")
    s3_region: str = Field("us-east-1", description="S3 region name.")
    s3_access_key_id: SecretStr = Field(SecretStr(""), description="S3 access key id.")
    s3_secret_access_key: SecretStr = Field(SecretStr(""), description="S3 secret access key.")
    s3_prefix: str = Field("", description="Key prefix under which every run namespace lives (e.g. 'datasets/').")
    s3_console_url: str | None = Field(
        None,
        description=(
            "Browser URL of a namespace in an S3 console, with {bucket} and {key} placeholders, for the run's "
            "dataset link (AWS S3 gets the AWS console without it)."
        ),
    )

    s3_link_expiry_s: int = Field(
        24 * 3600,
        ge=1,
        le=7 * 24 * 3600,
        description=(
            "How long the run's dataset link stays valid where it is a presigned URL of the dataset card (an S3 "
            "server on loopback: a laptop); SigV4 allows at most 7 days."
        ),
    )

    # --- Generation servers ----------------------------------------------------------------
    engine: Literal["sglang", "standin"] = Field(
        "sglang",
        description="What the pipeline launches: real SGLang, or the project's CPU stand-in (tests, demo).",
    )
    engine_python: str = Field(
        "python",
        description="Python interpreter of the engine's environment (SGLang often lives in its own venv).",
    )
    server_urls: list[str] = Field(
        default_factory=list,
        description="Attach mode: URLs of servers managed elsewhere. Empty means the pipeline starts its own.",
    )
    num_servers: int = Field(8, ge=1, description="Servers to start, one per GPU (ignored in attach mode).")
    server_host: str = Field("127.0.0.1", description="Address started servers bind to.")
    base_port: int = Field(
        30000,
        ge=0,
        le=65535,
        description="Port of server 0; server i listens on base_port+i. 0 picks free ports (tests, demo).",
    )
    sglang_api_key: SecretStr | None = Field(
        None, description="API key for the servers; when None, a random key is made for servers the pipeline starts."
    )

    server_start_timeout_s: float = Field(1800.0, gt=0, description="How long a server may take to become healthy.")
    server_hang_timeout_s: float = Field(
        30.0,
        gt=0,
        description="A server with requests that shows no progress this long (no request finished, no new "
        "scheduler snapshot in /v1/loads) is marked down and its requests go to the others.",
    )
    affinity_wait_s: float = Field(
        2.0,
        ge=0,
        description="Prefix affinity (every-turn steps, radix cache kept): the longest a step waits for the full "
        "server holding its conversation's prefix before it takes the first slot free anywhere; about the re-prefill "
        "it saves. 0: never wait (datagen/engine/dispatcher.py).",
    )
    run_lease_s: float = Field(
        180.0,
        ge=10,
        description="How long a run's hold on its namespace in S3 lasts unless renewed (every quarter of it): another "
        "run of the namespace is refused while it holds; one that died frees it this long after its last renewal, "
        "or at once when Prefect says its flow run is over (datagen/publishing/run_lease.py).",
    )

    # --- Local state -------------------------------------------------------------------------
    work_dir: Path = Field(
        Path(".datagen"), description="Checkpoints, server logs and Prefect task results (made 0700 by every run)."
    )
    data_roots: Annotated[list[Path], NoDecode] = Field(
        default_factory=lambda: [Path("data")],
        description=(
            "Directories prompt sources must resolve under (symlinks and '..' followed), separated by ':' like PATH "
            "(or a JSON list); relative roots are taken from the working directory (a deployed worker's is the "
            "checkout, so 'data' is its bundled prompts)."
        ),
    )
    model_roots: Annotated[list[Path], NoDecode] = Field(
        default_factory=lambda: [Path("/dev/shm/Qwen3.6-27B"), Path.home() / ".cache" / "datagen"],
        description=(
            "Directories RunSpec.model_path must resolve under, separated by ':' (or a JSON list): the staged model "
            "/dev/shm/Qwen3.6-27B (not all of /dev/shm, which every local user may write), and the fixture model "
            "directory of laptops and tests (~/.cache/datagen). The model directory and its files must also belong "
            "to this user or root and be writable by no one else."
        ),
    )
    hub_datasets: bool = Field(
        False,
        description=(
            "Let prompt sources name Hugging Face Hub datasets (org/name) that are not local paths under "
            "data_roots; off: every source is a local path under data_roots."
        ),
    )

    # --- Multi-box runs ----------------------------------------------------------------------
    box_name: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$",
        description=(
            "This box's name in multi-box runs: its work queue and the owner written on shard claims and "
            "checkpoint parts in S3. None means the host name."
        ),
    )

    # --- Environment checks ------------------------------------------------------------------
    skip_gpu_checks: bool = Field(False, description="Skip (and report as skipped) the GPU probe: laptops, CI.")
    allowed_compute_capabilities: list[str] = Field(
        default_factory=lambda: ["12.0"], description="Compute capabilities the GPUs must have."
    )
    require_tmpfs_model: bool = Field(True, description="Require the model directory to live on tmpfs.")

    @property
    def s3_target(self) -> str:
        """Where namespaces are published: endpoint, bucket and prefix (a run's files are kept per target)."""
        return f"{self.s3_endpoint_url or 'aws'} {self.s3_bucket} {self.s3_prefix}"

    @field_validator("data_roots", "model_roots", mode="before")
    @classmethod
    def _roots(cls, v: object) -> object:
        # From the environment: "/a:/b" as PATH is written (shell- and systemd-friendly), or a JSON list.
        if isinstance(v, str):
            return json.loads(v) if v.lstrip().startswith("[") else [p for p in v.split(os.pathsep) if p]
        return v

    @field_validator("sglang_api_key")
    @classmethod
    def _key_not_a_flag(cls, v: SecretStr | None) -> SecretStr | None:
        # SGLang's --config merge passes it as `--api-key <key>`: a leading "-" would read as another flag.
        if v is not None and v.get_secret_value().startswith("-"):
            raise ValueError("DATAGEN_SGLANG_API_KEY must not start with '-' (SGLang would read it as a flag)")
        return v
