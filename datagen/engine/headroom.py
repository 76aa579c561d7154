"""What an SGLang server needs outside its static pools while it serves, measured, and the fraction that leaves it.

SGLang splits the memory it sees before loading (P, "Load weight begin. avail mem") in two: `mem_fraction_static`
of it for the weights and the pools (state and KV), the rest, P (1 - fraction), for everything a running server
allocates later: the prefill and decode CUDA graphs it captures at start, and the activations of each forward
pass (the largest: a prefill chunk of `--chunked-prefill-size` tokens). When no fraction is given SGLang guesses
that rest for any model (`handle_gpu_memory_settings`: 1.5 MiB per prefill-chunk token, 2 MiB per decode graph
batch, at least 10 GiB on cards over 60 GiB, then 0.95x for a vision tower that text-only generation never
runs). For Qwen3.6-27B on a lent H100 (SGLang 0.5.17) that left 15 GB idle after every graph was captured (issue
45): the pools could have had a sixth more of the card.

A `Headroom` is that rest as measured for one engine version on one card: the CUDA graphs' memory read from a
server's own start-up log (`LoggedGraphs`), and the activation peak of a worst-case burst (full prefill chunks,
then a full decode batch) read as the growth of the GPU's used memory over the burst (PyTorch's caching allocator
keeps what it reserved, so the used memory after a burst is its peak). Per token of the prefill chunk and per
decode graph batch, so the same measurement sizes other chunk sizes and caps. `fraction` then gives the largest
`--mem-fraction-static` that leaves the measured need plus a margin:

    fraction = floor((P - graphs - activations - margin) / P, 3 decimals), at most MAX_FRACTION

An engine without a measured profile keeps SGLang's own fraction (the plan says so), and the pilot's
side-by-side trial can try the fraction a measured profile of another version would give on the users' own box
(`datagen.engine.plan_trial`): kept only if it survived a worst-case burst there, and faster.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, replace
from typing import Any

__all__ = [
    "HEADROOM",
    "MAX_FRACTION",
    "Headroom",
    "LoggedGraphs",
    "headroom_for",
]

_GIB = 1 << 30
_MIB = 1 << 20
# Never more than this of P for the weights and pools, whatever a measurement says (CUDA/NCCL workspaces that
# appear later, fragmentation after hours of mixed batch shapes).
MAX_FRACTION = 0.95


@dataclass(frozen=True)
class Headroom:
    """The memory one engine version needs outside its static pools, per unit of what the flags set, measured.

    `prefill_graph_bytes_per_token`: the prefill CUDA graphs (0.5.17 captures them for this model, `breakable`,
    up to the chunk size) per token of `--chunked-prefill-size`; 0 where the engine captures none.
    `decode_graph_bytes_per_batch`: the decode CUDA graphs per request of the largest captured batch.
    `activation_bytes_per_token`: the activation peak of a burst per token of the prefill chunk (a full chunk
    is the largest forward pass of a run: decode batches of a few hundred requests are far smaller).
    `margin_bytes`: kept free on top of the measured need. `source`: where and how it was measured.
    """

    engine: str
    prefill_graph_bytes_per_token: float
    decode_graph_bytes_per_batch: float
    activation_bytes_per_token: float
    margin_bytes: int
    source: str

    def need_bytes(self, chunk_tokens: int, decode_graph_batch: int) -> int:
        """Bytes outside the pools for a server with this prefill chunk and largest decode graph batch."""
        graphs = (
            self.prefill_graph_bytes_per_token * chunk_tokens + self.decode_graph_bytes_per_batch * decode_graph_batch
        )
        return math.ceil(graphs + self.activation_bytes_per_token * chunk_tokens) + self.margin_bytes

    def fraction(self, pre_model_load_bytes: int, chunk_tokens: int, decode_graph_batch: int) -> float:
        """The largest --mem-fraction-static (3 decimals, rounded down) that leaves `need_bytes` of P free."""
        if pre_model_load_bytes <= 0:
            raise ValueError("no GPU memory before the weights to take a fraction of")
        need = self.need_bytes(chunk_tokens, decode_graph_batch)
        return min(MAX_FRACTION, math.floor((pre_model_load_bytes - need) / pre_model_load_bytes * 1000) / 1000)

    def terms(self, chunk_tokens: int, decode_graph_batch: int) -> dict[str, int]:
        """Each part of `need_bytes`, for the plan's reasons and lineage."""
        return {
            "prefill_graphs": round(self.prefill_graph_bytes_per_token * chunk_tokens),
            "decode_graphs": round(self.decode_graph_bytes_per_batch * decode_graph_batch),
            "activations": round(self.activation_bytes_per_token * chunk_tokens),
            "margin": self.margin_bytes,
        }

    def describe(self, chunk_tokens: int, decode_graph_batch: int) -> str:
        """The need in one line: its parts in GiB and where they were measured."""
        t = self.terms(chunk_tokens, decode_graph_batch)
        return (
            f"prefill graphs {t['prefill_graphs'] / _GIB:.2f} GiB + decode graphs {t['decode_graphs'] / _GIB:.2f} "
            f"+ activations {t['activations'] / _GIB:.2f} + margin {t['margin'] / _GIB:.2f} at a {chunk_tokens:,}-"
            f"token prefill chunk and decode graphs to batch {decode_graph_batch} (SGLang {self.engine}: "
            f"{self.source})"
        )

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON for the lineage."""
        return asdict(self)

    @classmethod
    def measured(
        cls,
        engine: str,
        graphs: LoggedGraphs,
        activation_peak_bytes: int,
        *,
        margin_bytes: int,
        source: str,
    ) -> Headroom:
        """A profile from one server: its logged graphs and the activation peak a worst-case burst showed."""
        if graphs.chunk_tokens <= 0 or graphs.decode_graph_batch <= 0:
            raise ValueError("the log names no prefill chunk or decode graph batch to scale by")
        return cls(
            engine=engine,
            prefill_graph_bytes_per_token=graphs.prefill_graph_bytes / graphs.chunk_tokens,
            decode_graph_bytes_per_batch=graphs.decode_graph_bytes / graphs.decode_graph_batch,
            activation_bytes_per_token=max(0, activation_peak_bytes) / graphs.chunk_tokens,
            margin_bytes=margin_bytes,
            source=source,
        )


_CAPTURE_END = re.compile(
    r"Capture (?:target |draft )?(prefill|decode) CUDA graph end\..*?mem usage=([0-9.]+) GB, avail mem=([0-9.]+) GB"
)
_DECODE_BS = re.compile(r"Capture (?:target )?decode CUDA graph begin\..*?bs=\[([0-9, ]+)\]")
_CHUNK = re.compile(r"chunked_prefill_size=(\d+)")
_POOL_END = re.compile(r"Memory pool end\. avail mem=([0-9.]+) GB")
_READY_FREE = re.compile(r"available_gpu_mem=([0-9.]+) GB")


@dataclass(frozen=True)
class LoggedGraphs:
    """A server's CUDA graphs and free memory as its start-up log prints them (SGLang 0.5.17; GiB to 2 decimals).

    `pool_end_free_bytes`: free after the pools ("Memory pool end"); `prefill_graph_bytes` / `decode_graph_bytes`:
    what each capture took ("Capture ... CUDA graph end ... mem usage"; 0 when none was captured);
    `ready_free_bytes`: free once everything was captured (the scheduler's summary line); `chunk_tokens` and
    `decode_graph_batch`: the prefill chunk and the largest decode batch captured.
    """

    pool_end_free_bytes: int
    prefill_graph_bytes: int
    decode_graph_bytes: int
    ready_free_bytes: int
    chunk_tokens: int
    decode_graph_batch: int

    @classmethod
    def parse(cls, text: str) -> LoggedGraphs | None:
        """The last server start in `text`; None until its summary line (with the free memory) is there."""
        start = text.rfind("Load weight begin")
        text = text[start:] if start >= 0 else text
        pool_end, ready, chunk = _POOL_END.findall(text), _READY_FREE.findall(text), _CHUNK.findall(text)
        if not pool_end or not ready or not chunk:
            return None
        used = {"prefill": 0.0, "decode": 0.0}
        for phase, usage, _ in _CAPTURE_END.findall(text):
            used[phase] += float(usage)
        batches = _DECODE_BS.findall(text)
        largest = max((int(b) for b in batches[-1].split(",") if b.strip()), default=0) if batches else 0
        return cls(
            pool_end_free_bytes=round(float(pool_end[-1]) * _GIB),
            prefill_graph_bytes=round(used["prefill"] * _GIB),
            decode_graph_bytes=round(used["decode"] * _GIB),
            ready_free_bytes=round(float(ready[-1]) * _GIB),
            chunk_tokens=int(chunk[-1]),
            decode_graph_batch=largest,
        )


# Measured profiles, by engine version. 0.5.17 on the lent NVIDIA H100 80GB HBM3 (issue 45; 2026-12-07, the servers'
# logs and figures in benchmarks/results/real-engine-h100-80gb-hbm3/headroom/): prefill CUDA graphs 2.85 and 2.91 GiB
# at an 8,192-token chunk (two servers of that call; 2.85-2.89 in shared/reference/h100-plan-vs-expert), the larger
# kept; decode graphs 0.10 GiB to batch 38 and 0.20 to 99 (0.15 to 53 and 0.18 to 84 in the reference), at most
# 2.9 MiB a batch; activations: GPU memory in use grew by 2.27 GiB over a burst of 7,000-token prompts (full prefill
# chunks) and a 38-request decode bench after the server was ready, and by 2.11 GiB on the 0.916 server under 99
# running requests and 40 prompts of 7,000 tokens (no OOM, no retraction). The larger kept; 1 GiB of margin on top.
HEADROOM: dict[str, Headroom] = {
    "0.5.17": Headroom(
        engine="0.5.17",
        prefill_graph_bytes_per_token=2.91 * _GIB / 8192,
        decode_graph_bytes_per_batch=2.9 * _MIB,
        activation_bytes_per_token=2.27 * _GIB / 8192,
        margin_bytes=1 * _GIB,
        source="measured on an NVIDIA H100 80GB HBM3, SGLang 0.5.17, Qwen3.6-27B (issue 45)",
    ),
}


def headroom_for(version: str | None) -> Headroom | None:
    """The measured profile of SGLang `version`, or None (the plan then keeps SGLang's own fraction)."""
    return HEADROOM.get(version) if version else None


def scaled(profile: Headroom, engine: str, note: str) -> Headroom:
    """`profile` taken for another engine version (the pilot's trial tries it there; never the plan's default)."""
    return replace(profile, engine=engine, source=f"{profile.source}; taken for SGLang {engine}: {note}")
