"""Model-directory and host checks: weights complete, on tmpfs, tokenizer, template, processor present, room to work.

Weight files are verified without reading their data: a safetensors file starts with an 8-byte
little-endian header length and a JSON header whose largest `data_offsets` end is the size of the
data that must follow. A file shorter than 8 + header + data was truncated (an interrupted copy).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Iterable
from pathlib import Path

from datagen.checks import CheckResult

__all__ = [
    "EXPECTED_ARCHITECTURE",
    "SafetensorsError",
    "check_architecture",
    "check_chat_template",
    "check_exists",
    "check_free_ram",
    "check_free_space",
    "check_processor",
    "check_tmpfs",
    "check_tokenizer",
    "check_weights",
    "filesystem_of",
    "mem_available_bytes",
    "model_dir_checks",
    "safetensors_expected_size",
]

EXPECTED_ARCHITECTURE = "Qwen3_5ForConditionalGeneration"
_TMPFS_TYPES = frozenset({"tmpfs", "ramfs"})
_MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit on the JSON header
_GIB = 1024**3


class SafetensorsError(ValueError):
    """A safetensors header that cannot be read."""


def safetensors_expected_size(path: Path) -> int:
    """Size a complete safetensors file must have: 8 + header length + largest data_offsets end."""
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise SafetensorsError(f"{path.name}: {len(raw)} bytes, shorter than the 8-byte header length")
        (n,) = struct.unpack("<Q", raw)
        if n > _MAX_HEADER_BYTES:
            raise SafetensorsError(f"{path.name}: header length {n} is implausible (not a safetensors file?)")
        header_bytes = f.read(n)
    if len(header_bytes) < n:
        raise SafetensorsError(f"{path.name}: header cut short ({len(header_bytes)} of {n} bytes)")
    try:
        header = json.loads(header_bytes)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise SafetensorsError(f"{path.name}: header is not JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path.name}: header is not a JSON object")
    end = 0
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            raise SafetensorsError(f"{path.name}: tensor {key!r} has no valid data_offsets")
        end = max(end, int(offsets[1]))
    return 8 + int(n) + end


def _mount_point(p: str) -> str:
    # /proc/mounts escapes space, tab, newline and backslash as octal.
    for esc, ch in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        p = p.replace(esc, ch)
    return p


def filesystem_of(path: Path, mounts_text: str | None = None) -> tuple[str, str]:
    """(mount point, filesystem type) holding `path`: the longest mount-point prefix in /proc/mounts."""
    if mounts_text is None:
        mounts_text = Path("/proc/mounts").read_text(encoding="utf-8")
    target = os.path.realpath(path)
    best = ("", "unknown")
    for line in mounts_text.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        mp, fstype = _mount_point(fields[1]), fields[2]
        inside = target == mp or target.startswith(mp.rstrip("/") + "/")
        # Later lines for the same mount point shadow earlier ones (>= keeps the last).
        if inside and len(mp) >= len(best[0]):
            best = (mp, fstype)
    return best


def mem_available_bytes(meminfo_text: str | None = None) -> int:
    """MemAvailable from /proc/meminfo, in bytes (tmpfs pages, like a staged model, are not available)."""
    if meminfo_text is None:
        meminfo_text = Path("/proc/meminfo").read_text(encoding="utf-8")
    for line in meminfo_text.splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise ValueError("MemAvailable missing from /proc/meminfo")


def check_exists(model_dir: Path) -> CheckResult:
    """The model directory exists."""
    if model_dir.is_dir():
        return CheckResult("model_dir.exists", "pass", str(model_dir))
    return CheckResult(
        "model_dir.exists", "fail", f"{model_dir} is not a directory; stage the model there (e.g. copy it to /dev/shm)"
    )


def check_tmpfs(model_dir: Path, required: bool, mounts_text: str | None = None) -> CheckResult:
    """The model lives on tmpfs, so eight servers load it from RAM (when required)."""
    mp, fstype = filesystem_of(model_dir, mounts_text)
    where = f"{model_dir} is on {fstype} (mount {mp or '?'})"
    if not required:
        return CheckResult("model_dir.tmpfs", "skipped", f"not required (DATAGEN_REQUIRE_TMPFS_MODEL=false); {where}")
    if fstype in _TMPFS_TYPES:
        return CheckResult("model_dir.tmpfs", "pass", where)
    return CheckResult(
        "model_dir.tmpfs", "fail", f"{where}, not tmpfs; copy the model to /dev/shm so servers load it from RAM"
    )


def check_architecture(model_dir: Path, expected: str = EXPECTED_ARCHITECTURE) -> CheckResult:
    """config.json names the architecture the launch flags are made for."""
    name = "model_dir.architecture"
    config = model_dir / "config.json"
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return CheckResult(name, "fail", f"{config} is missing")
    except (OSError, json.JSONDecodeError) as exc:
        return CheckResult(name, "fail", f"{config} cannot be read: {exc}")
    archs = data.get("architectures") if isinstance(data, dict) else None
    if isinstance(archs, list) and expected in archs:
        return CheckResult(name, "pass", f"config.json: {expected}")
    return CheckResult(name, "fail", f"config.json architectures are {archs!r}, expected {expected!r} (wrong model?)")


def _weight_files(model_dir: Path) -> tuple[list[str], str] | str:
    """Weight file names (and where they came from), or why they cannot be listed."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            data = json.loads(index.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            return f"{index.name} cannot be read: {exc}"
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            return f"{index.name} has no weight_map"
        return sorted({str(v) for v in weight_map.values()}), index.name
    if (model_dir / "model.safetensors").exists():
        return ["model.safetensors"], "single file"
    return "no model.safetensors.index.json and no model.safetensors: the weights are not staged"


def check_weights(model_dir: Path) -> CheckResult:
    """Every weight file the index lists is present and as long as its header says."""
    name = "model_dir.weights"
    listed = _weight_files(model_dir)
    if isinstance(listed, str):
        return CheckResult(name, "fail", listed)
    files, source = listed
    problems: list[str] = []
    total = 0
    for fname in files:
        path = model_dir / fname
        if not path.is_file():
            problems.append(f"{fname} missing")
            continue
        try:
            expected = safetensors_expected_size(path)
        except (OSError, SafetensorsError) as exc:
            problems.append(str(exc))
            continue
        actual = path.stat().st_size
        total += actual
        if actual < expected:
            problems.append(f"{fname} truncated: {actual} of {expected} bytes")
        elif actual > expected:
            problems.append(f"{fname} has {actual - expected} bytes past its data (corrupt?)")
    if problems:
        shown = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
        return CheckResult(name, "fail", f"{shown} ({len(files)} files listed in {source}); copy the model again")
    return CheckResult(name, "pass", f"{len(files)} weight file(s), {total / _GIB:.1f} GB, complete ({source})")


def check_tokenizer(model_dir: Path) -> CheckResult:
    """tokenizer.json is present (prompts are tokenized with the model's own tokenizer)."""
    path = model_dir / "tokenizer.json"
    if path.is_file() and path.stat().st_size > 0:
        return CheckResult("model_dir.tokenizer", "pass", "tokenizer.json present")
    return CheckResult("model_dir.tokenizer", "fail", f"{path} is missing or empty")


def check_chat_template(model_dir: Path) -> CheckResult:
    """A chat template is present: chat_template.jinja, or chat_template in tokenizer_config.json."""
    name = "model_dir.chat_template"
    if (model_dir / "chat_template.jinja").is_file():
        return CheckResult(name, "pass", "chat_template.jinja present")
    config = model_dir / "tokenizer_config.json"
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        data = None
    if isinstance(data, dict) and isinstance(data.get("chat_template"), str | list) and data["chat_template"]:
        return CheckResult(name, "pass", "chat_template in tokenizer_config.json")
    return CheckResult(name, "fail", f"no chat_template.jinja and no chat_template in {config.name}")


def _json_object(path: Path) -> dict[str, object] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    return data if isinstance(data, dict) else None


def check_processor(model_dir: Path) -> CheckResult:
    """The vision processor's configs are present: SGLang 0.5.23 loads Qwen3.6's processor at startup.

    Real SGLang starts Qwen3.6 with its vision tower (`--language-model-only` is rejected for this
    architecture), so its tokenizer manager calls transformers' AutoProcessor (Qwen3VLProcessor), which
    reads the image processor from processor_config.json["image_processor"] or preprocessor_config.json,
    and the video processor from processor_config.json["video_processor"], video_preprocessor_config.json
    or, failing both, preprocessor_config.json (transformers 5.19, the release sglang 0.5.23 pins).
    """
    name = "model_dir.processor"
    processor = _json_object(model_dir / "processor_config.json") or {}
    pre = _json_object(model_dir / "preprocessor_config.json")
    video_pre = _json_object(model_dir / "video_preprocessor_config.json")
    image = "preprocessor_config.json" if pre is not None else None
    if image is None and isinstance(processor.get("image_processor"), dict):
        image = "processor_config.json"
    video = next(
        (
            label
            for label, ok in (
                ("processor_config.json", isinstance(processor.get("video_processor"), dict)),
                ("video_preprocessor_config.json", video_pre is not None),
                ("preprocessor_config.json", pre is not None),
            )
            if ok
        ),
        None,
    )
    if image and video:
        return CheckResult(name, "pass", f"image processor from {image}, video processor from {video}")
    missing = [what for what, found in (("image", image), ("video", video)) if not found]
    return CheckResult(
        name,
        "fail",
        f"no readable {' or '.join(missing)} processor config (preprocessor_config.json, "
        "video_preprocessor_config.json or processor_config.json): SGLang loads Qwen3.6's vision processor "
        "at startup and exits without it; copy these files from the checkpoint",
    )


def _existing_ancestor(path: Path) -> Path:
    p = path.absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def check_free_space(name: str, path: Path, min_bytes: int, purpose: str) -> CheckResult:
    """At least `min_bytes` free on the filesystem that holds `path` (or would hold it)."""
    where = _existing_ancestor(path)
    try:
        free = shutil.disk_usage(where).free
    except OSError as exc:
        return CheckResult(name, "fail", f"cannot read free space of {where}: {exc}")
    detail = f"{free / _GIB:.1f} GB free at {where} ({purpose}; need {min_bytes / _GIB:.1f} GB)"
    return CheckResult(name, "pass" if free >= min_bytes else "fail", detail)


def check_free_ram(min_bytes: int, meminfo_text: str | None = None) -> CheckResult:
    """At least `min_bytes` of MemAvailable."""
    try:
        avail = mem_available_bytes(meminfo_text)
    except (OSError, ValueError) as exc:
        return CheckResult("host.free_ram", "fail", f"cannot read /proc/meminfo: {exc}")
    detail = f"{avail / _GIB:.1f} GB available (need {min_bytes / _GIB:.1f} GB)"
    return CheckResult("host.free_ram", "pass" if avail >= min_bytes else "fail", detail)


def _skipped(names: Iterable[str], why: str) -> list[CheckResult]:
    return [CheckResult(n, "skipped", why) for n in names]


def model_dir_checks(
    model_dir: Path, *, require_tmpfs: bool, weights_skip_reason: str | None = None
) -> list[CheckResult]:
    """Every model-directory check in report order (the rest are skipped when the directory is missing)."""
    exists = check_exists(model_dir)
    if exists.failed:
        rest = ["model_dir.tmpfs", "model_dir.architecture", "model_dir.weights", "model_dir.tokenizer"]
        rest += ["model_dir.chat_template", "model_dir.processor"]
        return [exists, *_skipped(rest, f"{model_dir} does not exist")]
    weights = (
        check_weights(model_dir)
        if weights_skip_reason is None
        else CheckResult("model_dir.weights", "skipped", weights_skip_reason)
    )
    return [
        exists,
        check_tmpfs(model_dir, require_tmpfs),
        check_architecture(model_dir),
        weights,
        check_tokenizer(model_dir),
        check_chat_template(model_dir),
        check_processor(model_dir),
    ]
