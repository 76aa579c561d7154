"""Start, watch and stop the generation servers: one SGLang (or stand-in) process per GPU.

The stand-in is launched through exactly the same code path as SGLang, with the same flags; only
the interpreter and module differ (`engine_command`). SGLang's launch flags live here and nowhere else.

Errors::

    ServerStartError        a server exited or did not become healthy in time; the message holds
                            the last lines of its log (what a person reads in the Prefect UI)
    └── PortInUseError      a server's port already answers before we start anything

Teardown is guaranteed for every server the pipeline started: each runs in its own process group,
which gets SIGTERM, then SIGKILL after a grace period, when the fleet's `with` block ends (success,
exception, KeyboardInterrupt), at interpreter exit (atexit) and on SIGTERM/SIGHUP to this process.
A SIGKILL of this process cannot be intercepted; its servers then outlive it.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import random
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType, TracebackType
from typing import IO, Any, overload
from urllib.parse import urlsplit

import httpx
from pydantic import SecretStr

from datagen.checks.tuning import check_server_args
from datagen.engine.endpoints import ServerEndpoint
from datagen.engine.memory_plan import LoggedPools, MemoryPlan, pool_shortfall
from datagen.layout import RunLayout
from datagen.operations.redact import redact_lines, redact_text
from datagen.paths import private_dir, private_file
from datagen.processes import is_process, start_ticks
from datagen.runspec import RunSpec
from datagen.settings import Settings

__all__ = [
    "ATTACH_HEALTH_TIMEOUT_S",
    "LOG_TAIL_LINES",
    "STOP_GRACE_S",
    "PoolShortError",
    "PortInUseError",
    "ServerFleet",
    "ServerStartError",
    "arch_args",
    "engine_command",
    "ephemeral_low",
    "free_ports_below_ephemeral",
    "launch_flags",
    "log_tail",
    "mask_command",
    "reap_orphaned_servers",
    "server_command",
    "server_env",
    "stop_process_group",
    "write_key_config",
]

logger = logging.getLogger(__name__)

STOP_GRACE_S = 30.0  # SIGTERM -> SIGKILL; SGLang's own shutdown kills its scheduler children within this
LOG_TAIL_LINES = 30
ATTACH_HEALTH_TIMEOUT_S = 60.0  # attached servers should already be up; don't wait half an hour for a typo
_POLL_S = 0.25
_POOL_LOG_WAIT_S = 10.0  # after /health answers, how long the scheduler's pool lines may take to reach the log
_HEALTH_TIMEOUT_S = 25.0  # SGLang's /health handler may poll its scheduler for up to 20 s
_MASK = "***"
_FLEETS_DIR = "fleets"  # under Settings.work_dir: what each live fleet started (reap_orphaned_servers)
_SECRET_FLAGS = ("--api-key", "--admin-api-key")


class ServerStartError(RuntimeError):
    """A server exited or did not become healthy; the message ends with the last lines of its log."""

    def __init__(self, name: str, reason: str, log_path: Path | None, tail: Sequence[str]) -> None:
        self.name = name
        self.reason = reason
        self.log_path = log_path
        self.tail = list(tail)
        where = f" (log: {log_path})" if log_path else ""
        text = f"server {name} {reason}{where}"
        if self.tail:
            text += f"\n--- last {len(self.tail)} log lines ---\n" + "\n".join(self.tail)
        super().__init__(text)

    @property
    def headline(self) -> str:
        """One line for the run's state message: the server, what happened, the last error line of its log."""
        errors = [line.strip() for line in self.tail if "error" in line.lower()]
        last = (errors or [line.strip() for line in self.tail if line.strip()] or [""])[-1]
        return f"server {self.name} {self.reason}" + (f": {last}" if last else "")


class PoolShortError(ServerStartError):
    """A server's pools (its log) are short of the memory plan's prediction, also after one recalibrated relaunch."""


class PortInUseError(ServerStartError):
    """Something already listens on a port a server was about to use (a leftover server, say)."""


# --- command lines ---------------------------------------------------------------------------------


def engine_command(settings: Settings) -> list[str]:
    """Interpreter and module that start one server: SGLang in its own venv, or the stand-in."""
    if settings.engine == "standin":
        return [sys.executable, "-m", "datagen.standin"]
    return [settings.engine_python, "-m", "sglang.launch_server"]


def _flag_given(args: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def arch_args(capabilities: Sequence[str], user_args: Sequence[str] = ()) -> list[str]:
    """Flags chosen by GPU architecture: flashinfer attention on SM120 (FA3/FA4 are rejected there)."""
    sm120 = any(c.split(".", 1)[0] == "12" for c in capabilities)
    # An explicit choice in the run spec wins; the environment check rejects fa3/fa4 on SM120.
    if sm120 and not _flag_given(user_args, "--attention-backend"):
        return ["--attention-backend", "flashinfer"]
    return []  # elsewhere SGLang's own default (fa3 on Hopper, triton/trtllm_mha on SM100)


def write_key_config(path: Path, api_key: SecretStr) -> Path:
    """Write the servers' key as an SGLang `--config` YAML file, mode 0600 (no key on any command line)."""
    if api_key.get_secret_value().startswith("-"):
        # The merge hands SGLang `--api-key <key>`, where a leading "-" reads as a flag (argparse exits 2).
        raise ValueError("the servers' API key must not start with '-' (SGLang would read it as a flag)")
    private_dir(path.parent)
    # SGLang turns each key into `--<key> <value>` as written, hence "api-key"; JSON quoting keeps it a string.
    with os.fdopen(private_file(path), "w") as f:
        f.write(f"api-key: {json.dumps(api_key.get_secret_value())}\n")
    return path


def launch_flags(
    settings: Settings,
    spec: RunSpec,
    port: int,
    key_config: Path,
    nccl_port: int | None = None,
    plan_args: Sequence[str] = (),
) -> list[str]:
    """Every launch flag of one server; the key comes from `key_config` (write_key_config), never the argv.

    `plan_args`: the memory plan's tuning flags (`memory_plan.MemoryPlan.plan_args`, which never repeats a flag
    the run spec sets); they come before `spec.server_args`, so the spec's own flags win. Both pass the same
    tuning allow-list.
    """
    # Again here: a RunSpec built without validation must not get through, nor a plan that names a managed flag.
    check_server_args([*plan_args, *spec.server_args])
    flags = [
        "--model-path",
        spec.model_path,
        "--served-model-name",
        spec.served_model_name,
        "--host",
        settings.server_host,
        "--port",
        str(port),
        # SGLang 0.5.23 reads a key only from its argv or a `--config` YAML file (no environment variable):
        # the file keeps it out of /proc/<pid>/cmdline and `ps`, which every local user can read.
        "--config",
        str(key_config),
        "--tp-size",
        "1",  # one server per GPU: PCIe-only boxes, no tensor parallelism
        "--reasoning-parser",
        "qwen3",
        # No --language-model-only: 0.5.23 rejects it for Qwen3.6 at settings resolution (its allow-list,
        # ServerArgs.LANGUAGE_MODEL_ONLY_ARCHITECTURES, omits Qwen3_5ForConditionalGeneration); the vision
        # tower loads. tests/conformance/test_launch_conformance.py resolves this argv with the real code.
        "--context-length",
        str(spec.context_length),
    ]
    if nccl_port is not None:
        # Servers started together otherwise each pick "a free port" and can pick the same one.
        flags += ["--nccl-port", str(nccl_port)]
    arch = arch_args(settings.allowed_compute_capabilities, spec.server_args)
    return [*flags, *arch, *plan_args, *spec.server_args]


def server_command(
    settings: Settings,
    spec: RunSpec,
    index: int,
    key_config: Path,
    nccl_port: int | None = None,
    plan_args: Sequence[str] = (),
) -> list[str]:
    """The full argv of server `index` (listening on base_port + index)."""
    flags = launch_flags(settings, spec, settings.base_port + index, key_config, nccl_port, plan_args)
    return [*engine_command(settings), *flags]


def mask_command(argv: Sequence[str]) -> str:
    """The command line as a shell string with API key values replaced by ***."""
    out: list[str] = []
    hide_next = False
    for arg in argv:
        if hide_next:
            out.append(_MASK)
            hide_next = False
            continue
        flag = arg.split("=", 1)[0]
        # argparse accepts unambiguous abbreviations (--api-k), so those carry the key too.
        secret = len(flag) > 5 and any(s.startswith(flag) for s in _SECRET_FLAGS)
        if secret and "=" in arg:
            out.append(f"{flag}={_MASK}")
        elif secret:
            out.append(arg)
            hide_next = True
        else:
            out.append(arg)
    return shlex.join(out)


# What a server inherits from the pipeline's environment: the toolchain, GPU and engine settings, nothing
# else. The pipeline's own secrets (DATAGEN_S3_*, DATAGEN_SGLANG_API_KEY, PREFECT_API_AUTH_STRING, AWS_*) and
# anything secret-looking under an allowed prefix (HF_TOKEN) stay out of /proc/<pid>/environ.
_ENV_NAMES = frozenset(
    {"PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "TZ", "TMPDIR", "TERM", "SHELL", "VIRTUAL_ENV"}
    | {"LD_LIBRARY_PATH", "PYTHONPATH", "PYTHONHASHSEED", "OMP_NUM_THREADS", "TOKENIZERS_PARALLELISM"}
    | {"XDG_CACHE_HOME", "CC", "CXX"}
)
_ENV_PREFIXES = (
    "LC_",
    "CUDA_",
    "NCCL_",
    "NVIDIA_",
    "HF_",
    "TRANSFORMERS_",
    "SGLANG_",
    "TORCH",
    "TRITON_",
    "FLASHINFER_",
    "MKL_",
    "DATAGEN_STANDIN_",
)
_SECRET_ENV = re.compile(r"TOKEN(?!IZERS?_)|SECRET|PASSW|CREDENTIAL|(^|_)KEY(_|$)|API_?KEY|AUTH")


def _inherited(name: str) -> bool:
    allowed = name in _ENV_NAMES or name.startswith(_ENV_PREFIXES)
    return allowed and not _SECRET_ENV.search(name.upper())


def server_env(index: int, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment of server `index`: allow-listed variables only, GPU `index` visible as nvidia-smi numbers it."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if _inherited(k)}
    env["CUDA_VISIBLE_DEVICES"] = str(index)
    # CUDA's default order is "fastest first"; PCI order makes index i the GPU nvidia-smi calls i.
    env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    env["PYTHONUNBUFFERED"] = "1"  # so the log tail in an error message is current
    return env


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> list[str]:
    """The last `lines` lines of a log file (empty when it does not exist)."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 256 * 1024))
            data = f.read()
    except OSError:
        return []
    return data.decode("utf-8", "replace").splitlines()[-lines:]


# --- processes -------------------------------------------------------------------------------------


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop_process_group(proc: subprocess.Popen[bytes], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM the process group led by `proc`, SIGKILL whatever is left after `grace_s`, reap the leader."""
    pgid = proc.pid  # started with start_new_session=True: pid == pgid
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        proc.poll()  # reap the leader, or the group stays "alive" as a zombie
        if not _group_alive(pgid):
            return
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def _port_open(host: str, port: int, timeout: float = 1.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


# Below Linux's default ephemeral range (32768-60999): the kernel never hands these ports to an outgoing
# connection or a port-0 bind, so a port found free stays free unless someone asks for it by number.
_AUTO_PORT_RANGE = (20000, 32768)


def _free_base_port(n: int, attempts: int = 200) -> int:
    """A port P with P..P+n-1 all free now (Settings.base_port 0: tests and the demo share one machine)."""
    rng = random.Random()
    for _ in range(attempts):
        base = rng.randrange(_AUTO_PORT_RANGE[0], _AUTO_PORT_RANGE[1] - n)
        if all(_port_is_free(base + i) for i in range(n)):
            return base
    lo, hi = _AUTO_PORT_RANGE
    raise PortInUseError("fleet", f"found no {n} consecutive free ports between {lo} and {hi}", None, ())


def _port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def ephemeral_low(path: Path = Path("/proc/sys/net/ipv4/ip_local_port_range")) -> int:
    """First port of the kernel's ephemeral range (32768 when it cannot be read)."""
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_ports_below_ephemeral(n: int, exclude: Iterable[int], attempts: int = 2000) -> list[int]:
    """`n` distinct ports free now on all interfaces, below the ephemeral range and none in `exclude`.

    For ports a server binds only later (NCCL's TCPStore): a port the kernel may hand to any outgoing
    connection or port-0 bind in the meantime would be taken by then. SGLang picks its own NCCL port the
    same way (`utils/network.py: get_free_port_below_ephemeral`, binding 0.0.0.0).
    """
    lo, hi = _AUTO_PORT_RANGE[0], min(_AUTO_PORT_RANGE[1], ephemeral_low()) - 1
    taken = set(exclude)
    candidates = [p for p in range(lo, hi + 1) if p not in taken]
    rng = random.Random()
    rng.shuffle(candidates)
    ports: list[int] = []
    for port in candidates[:attempts]:
        if _port_is_free(port, "0.0.0.0"):
            ports.append(port)
            if len(ports) == n:
                return ports
    raise PortInUseError("fleet", f"found no {n} free NCCL ports between {lo} and {hi}", None, ())


def _connect_host(host: str) -> str:
    # A server bound to all interfaces is reached through loopback.
    return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)


def _url(host: str, port: int) -> str:
    h = _connect_host(host)
    return f"http://[{h}]:{port}" if ":" in h else f"http://{h}:{port}"


def _read_capacity(info: Mapping[str, Any]) -> int | None:
    states = info.get("internal_states")
    if isinstance(states, list) and states:
        values = [s.get("effective_max_running_requests_per_dp") for s in states if isinstance(s, dict)]
        if values and all(isinstance(v, int) and v > 0 for v in values):
            return sum(v for v in values if isinstance(v, int))
    fallback = info.get("max_running_requests")
    return fallback if isinstance(fallback, int) and fallback > 0 else None


@dataclass
class _Server:
    """One server the fleet manages (started by us, or attached)."""

    name: str
    url: str
    index: int
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    log_path: Path | None = None
    proc: subprocess.Popen[bytes] | None = None
    log_file: IO[bytes] | None = None
    endpoint: ServerEndpoint | None = None
    ready_at: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)
    nccl_port: int | None = None
    log_offset: int = 0  # where this launch's lines start in log_path (restarts append)
    plan: MemoryPlan | None = None  # the memory plan this server was launched with (PoolCheck)
    pools: LoggedPools | None = None  # what the engine logged it allocated, once checked
    recalibrated: bool = False  # relaunched once with the plan recalibrated from an engine log


# --- teardown on exit and signals ------------------------------------------------------------------

_live_fleets: set[ServerFleet] = set()
_registry_lock = threading.RLock()
_previous_handlers: dict[int, Any] = {}
_TEARDOWN_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def _stop_all_fleets() -> None:
    with _registry_lock:
        fleets = list(_live_fleets)
    for fleet in fleets:
        fleet.stop()


def _on_signal(signum: int, frame: FrameType | None) -> None:
    logger.warning("signal %d: stopping the servers this process started", signum)
    _stop_all_fleets()
    previous = _previous_handlers.get(signum, signal.SIG_DFL)
    if callable(previous):
        previous(signum, frame)  # e.g. Prefect's own cancellation handler
    elif previous != signal.SIG_IGN:
        # Default action was "terminate": exit, unwinding `finally` blocks on the way.
        raise SystemExit(128 + signum)


def _register(fleet: ServerFleet) -> None:
    with _registry_lock:
        _live_fleets.add(fleet)
        if threading.current_thread() is not threading.main_thread() or _previous_handlers:
            return  # handlers can only be set from the main thread; atexit and __exit__ still apply
        for sig in _TEARDOWN_SIGNALS:
            _previous_handlers[sig] = signal.getsignal(sig)
            signal.signal(sig, _on_signal)


def _unregister(fleet: ServerFleet) -> None:
    with _registry_lock:
        _live_fleets.discard(fleet)
        if _live_fleets or not _previous_handlers:
            return
        if threading.current_thread() is threading.main_thread():
            for sig, handler in _previous_handlers.items():
                signal.signal(sig, handler)
            _previous_handlers.clear()


atexit.register(_stop_all_fleets)


# --- servers outliving a killed pipeline ---------------------------------------------------------------
# SIGKILL (or the OOM killer) skips every teardown above, and a server survives its pipeline: eight of them
# keep eight GPUs. Each fleet therefore records what it started in <work_dir>/fleets/, and the next run on
# the box stops what a dead fleet left behind before its environment checks look at the GPUs.


# The old names (datagen.operations.prefect_reaper and tests use them); the bodies are datagen.processes'.
_start_ticks = start_ticks
_is_process = is_process


def reap_orphaned_servers(work_dir: Path, grace_s: float = STOP_GRACE_S) -> list[str]:
    """Stop servers that fleets recorded under `work_dir` and whose own process has died; one line per server.

    A live fleet's servers are never touched (its process is alive, whoever it is), nor a process whose pid
    was reused since (start times differ).
    """
    # Started with start_new_session (pid == pgid): the whole group goes, SGLang's scheduler children too.
    reaped = reap_recorded(work_dir / _FLEETS_DIR, "fleet record", os.killpg, grace_s, kill_group=True)
    # A dead fleet's key file (named <pid>-<start>-...): no server of it runs any more.
    for key_file in (work_dir / _FLEETS_DIR).glob("*.key.yaml"):
        pid, start = key_file.name.split("-")[:2]
        if pid.isdigit() and start.isdigit() and not _is_process(int(pid), int(start)):
            key_file.unlink(missing_ok=True)
    return reaped


def reap_recorded(
    records_dir: Path,
    what: str,
    kill: Callable[[int, int], None],
    grace_s: float = STOP_GRACE_S,
    kill_group: bool = False,
) -> list[str]:
    """Stop the processes listed in `records_dir/*.json` whose recorded owner process has died.

    Each record is {"owner": {"pid", "start"}, "servers": {name: {"pid", "start", "url"}}}; `kill(pid, sig)`
    sends the signals (os.killpg for a process group, os.kill for one process). With `kill_group` the final
    SIGKILL always goes (whatever of the group is left), otherwise only to a process still alive.
    """
    reaped: list[str] = []
    for path in sorted(records_dir.glob("*.json")):
        try:
            record = json.loads(path.read_text())
            owner_pid, owner_start = int(record["owner"]["pid"]), record["owner"]["start"]
            servers = dict(record["servers"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            logger.warning("ignoring unreadable %s %s: %s", what, path, exc)
            continue
        if _is_process(owner_pid, owner_start):
            continue
        for name, info in sorted(servers.items()):
            pid, start = int(info["pid"]), info.get("start")
            if not _is_process(pid, start):
                continue
            logger.warning("stopping %s (pid %d, %s) left running by a pipeline that died", name, pid, info["url"])
            try:
                kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
            except PermissionError:
                logger.warning("cannot stop %s (pid %d): it belongs to another user", name, pid)
                continue
            deadline = time.monotonic() + grace_s
            while _is_process(pid, start) and time.monotonic() < deadline:
                time.sleep(0.1)
            if kill_group or _is_process(pid, start):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    kill(pid, signal.SIGKILL)
            reaped.append(f"{name} (pid {pid}, {info['url']})")
        path.unlink(missing_ok=True)
    return reaped


# --- the fleet -------------------------------------------------------------------------------------


class ServerFleet(Sequence[ServerEndpoint]):
    """The pipeline's servers: started (or attached) on `with`, always stopped after; a sequence of endpoints.

    Attach mode (Settings.server_urls non-empty): servers managed elsewhere are only health-checked,
    never started, restarted or stopped.
    """

    def __init__(
        self,
        settings: Settings,
        spec: RunSpec,
        layout: RunLayout,
        api_key: SecretStr,
        *,
        stop_grace_s: float = STOP_GRACE_S,
        attach_timeout_s: float = ATTACH_HEALTH_TIMEOUT_S,
        plan_args: Sequence[str] = (),
        server_plan_args: Sequence[Sequence[str]] | None = None,
        memory_plan: MemoryPlan | None = None,
        pool_tolerance: float = 0.02,
    ) -> None:
        # Base port 0: the fleet picks free ports itself, and picks again at start() if one was taken since.
        self._auto_ports = settings.base_port == 0 and not settings.server_urls
        if self._auto_ports:
            settings = settings.model_copy(update={"base_port": _free_base_port(settings.num_servers)})
        self.settings = settings
        self.spec = spec
        self.layout = layout
        self._api_key = api_key
        self.stop_grace_s = stop_grace_s
        self.attach_timeout_s = attach_timeout_s
        # The pool check (issue 37): after a launched server is healthy, the pools its log reports are compared
        # with `memory_plan`'s prediction; short ones relaunch it once with the plan recalibrated from that log,
        # and fail with both sets of numbers if the relaunch is short too. Its flags are `plan_args` then.
        self.memory_plan = memory_plan
        self.pool_tolerance = pool_tolerance
        if memory_plan is not None and not plan_args:
            plan_args = memory_plan.plan_args
        self.plan_args = list(plan_args)
        # One flag list per server (a pilot's side-by-side trial of candidate plans), else plan_args for all.
        if server_plan_args is not None and len(server_plan_args) != settings.num_servers:
            raise ValueError(f"server_plan_args: {len(server_plan_args)} lists for {settings.num_servers} servers")
        self.server_plan_args = [list(a) for a in server_plan_args] if server_plan_args is not None else None
        self.attached = bool(settings.server_urls)
        self.engine_version: str | None = None
        self._servers: list[_Server] = []
        self._stopped = False
        # Set by stop(): a restart still waiting for its server gives up at once. Unset, the wait (60 s attached,
        # server_start_timeout_s started) ran on in an executor thread that the interpreter joins at exit: the
        # pipeline lingered 32 s past its flow's end after a server was killed (issue 24).
        self._closing = threading.Event()
        # Orders "may we launch?" against stop(): a restart racing a teardown must not leak a server.
        # Re-entrant: a SIGTERM handler may run stop() on the thread that holds it.
        self._launch_lock = threading.RLock()
        self._record_lock = threading.Lock()
        me = os.getpid()
        self._record_path = settings.work_dir / _FLEETS_DIR / f"{me}-{_start_ticks(me)}-{id(self):x}.json"
        # The servers' key, read by each server at start (restarts too); 0600 in a 0700 directory, removed at stop.
        self._key_config = settings.work_dir / _FLEETS_DIR / f"{me}-{_start_ticks(me)}-{id(self):x}.key.yaml"
        if self.attached:
            self._servers = [
                _Server(name=f"server-{i}", url=url.rstrip("/"), index=i) for i, url in enumerate(settings.server_urls)
            ]
        else:
            self._servers = self._plan_servers(settings)

    def _plan_servers(self, settings: Settings) -> list[_Server]:
        """One server per GPU on base_port + i, each with its own NCCL port outside the serving ports."""
        serving = range(settings.base_port, settings.base_port + settings.num_servers)
        nccl_ports = free_ports_below_ephemeral(settings.num_servers, exclude=serving)
        # Per-server trial arms (server_plan_args) are compared by the pilot itself, not against one prediction.
        plan = self.memory_plan if self.server_plan_args is None else None
        return [
            _Server(
                name=f"gpu{i}",
                url=_url(settings.server_host, settings.base_port + i),
                index=i,
                argv=server_command(settings, self.spec, i, self._key_config, nccl_ports[i], self._plan_args_of(i)),
                env=server_env(i),
                log_path=self.layout.logs_dir / f"server-{i}.log",
                nccl_port=nccl_ports[i],
                plan=plan,
            )
            for i in range(settings.num_servers)
        ]

    def _plan_args_of(self, index: int) -> list[str]:
        return self.server_plan_args[index] if self.server_plan_args is not None else self.plan_args

    # Sequence[ServerEndpoint] ---------------------------------------------------------------------

    @property
    def endpoints(self) -> list[ServerEndpoint]:
        """Current endpoint of every ready server, in server order."""
        return [s.endpoint for s in self._servers if s.endpoint is not None]

    @overload
    def __getitem__(self, index: int) -> ServerEndpoint: ...
    @overload
    def __getitem__(self, index: slice) -> list[ServerEndpoint]: ...
    def __getitem__(self, index: int | slice) -> ServerEndpoint | list[ServerEndpoint]:
        return self.endpoints[index]

    def __len__(self) -> int:
        return len(self.endpoints)

    def __iter__(self) -> Iterator[ServerEndpoint]:
        return iter(self.endpoints)

    def __hash__(self) -> int:  # identity: fleets live in a set for atexit/signal teardown
        return id(self)

    def __eq__(self, other: object) -> bool:
        return self is other

    # lifecycle --------------------------------------------------------------------------------------

    def __enter__(self) -> ServerFleet:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def pids(self) -> dict[str, int]:
        """Process (and process-group) id of every server this fleet started and has not stopped."""
        return {s.name: s.proc.pid for s in self._servers if s.proc is not None}

    def start(self) -> list[ServerEndpoint]:
        """Start every server (or check attached ones) and wait until all are healthy; stop all on failure."""
        if self.attached:
            self._wait_all(self._servers, self.attach_timeout_s)
            return self.endpoints
        self._stopped = False
        _register(self)
        try:
            private_dir(self.layout.logs_dir)
            write_key_config(self._key_config, self._api_key)
            self._claim_ports()
            for server in self._servers:
                self._launch(server, note="starting")
            self._wait_all(self._servers, self.settings.server_start_timeout_s)
        except BaseException:
            self.stop()
            raise
        return self.endpoints

    def stop(self) -> None:
        """Stop every server this fleet started (attached servers are never touched); idempotent."""
        self._closing.set()
        if self.attached:
            return
        with self._launch_lock:
            self._stopped = True
            started = [s for s in self._servers if s.proc is not None]
        if started:
            logger.info("stopping %d server(s)", len(started))
        # In parallel: eight servers each taking the full grace period would otherwise add up.
        with ThreadPoolExecutor(max_workers=max(1, len(started))) as pool:
            list(pool.map(self._stop_server, started))
        self._key_config.unlink(missing_ok=True)
        _unregister(self)

    def endpoint(self, name: str) -> ServerEndpoint:
        """The current endpoint of server `name`."""
        server = self._find(name)
        if server.endpoint is None:
            raise KeyError(f"server {name} is not ready")
        return server.endpoint

    def restart(self, server: str | ServerEndpoint) -> None:
        """Restart one server and wait until it is healthy again (usable as the dispatcher's on_server_down).

        In attach mode the server is only waited for. Calls that arrive while a restart of the same
        server is under way wait for that restart instead of starting another.
        """
        name = server if isinstance(server, str) else server.name
        target = self._find(name)
        asked_at = time.monotonic()
        with target.lock:
            if target.ready_at > asked_at:
                return  # another caller restarted it after we asked
            if self.attached:
                with contextlib.suppress(_Aborted):  # the fleet stopped: nobody waits for this server any more
                    self._wait_ready(target, self.attach_timeout_s, self._closing)
                return
            logger.warning("restarting server %s", name)
            self._stop_server(target)
            self._launch(target, note="restarting")
            try:
                self._wait_ready(target, self.settings.server_start_timeout_s, self._closing)
            except _Aborted:
                self._stop_server(target)
            except BaseException:
                self._stop_server(target)
                raise

    def relaunch(self, index: int, plan_args: Sequence[str]) -> None:
        """Restart the `index`-th server with other plan flags and wait until it is healthy (the pilot's trial: an
        arm that did not hold its worst-case burst runs another from then on, restarts included)."""
        if self.attached:
            raise ValueError("attach mode: the servers' flags are set elsewhere")
        target = self._servers[index]
        with self._launch_lock:
            if self.server_plan_args is not None:
                self.server_plan_args[target.index] = list(plan_args)
            target.argv = server_command(
                self.settings, self.spec, target.index, self._key_config, target.nccl_port, list(plan_args)
            )
        self.restart(target.name)

    # internals --------------------------------------------------------------------------------------

    def _find(self, name: str) -> _Server:
        for s in self._servers:
            if s.name == name:
                return s
        raise KeyError(f"no server named {name!r} (have {', '.join(s.name for s in self._servers)})")

    def _claim_ports(self, attempts: int = 5) -> None:
        """Fail before launching anything if a serving port answers; with chosen ports, choose again."""
        for attempt in range(attempts):
            try:
                for server in self._servers:
                    self._check_port_free(server)
                return
            except PortInUseError as exc:
                if not self._auto_ports or attempt == attempts - 1:
                    raise
                logger.warning("%s; choosing other ports", exc)
                self.settings = self.settings.model_copy(
                    update={"base_port": _free_base_port(self.settings.num_servers)}
                )
                self._servers = self._plan_servers(self.settings)

    def _check_port_free(self, server: _Server) -> None:
        parts = urlsplit(server.url)
        if parts.hostname and parts.port and _port_open(parts.hostname, parts.port):
            raise PortInUseError(
                server.name,
                f"cannot start: port {parts.port} already answers (a leftover server? find it with "
                f"`ss -ltnp 'sport = :{parts.port}'`, or choose another DATAGEN_BASE_PORT)",
                None,
                [],
            )

    def _launch(self, server: _Server, note: str) -> None:
        assert server.log_path is not None
        with self._launch_lock:
            if self._stopped:
                raise RuntimeError(f"the fleet is stopped; not {note} {server.name}")
            self._popen(server, server.log_path, note)

    def _popen(self, server: _Server, log_path: Path, note: str) -> None:
        log_file = os.fdopen(private_file(log_path, append=True), "ab")  # SGLang logs its key at startup
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        shown = f"CUDA_VISIBLE_DEVICES={server.env['CUDA_VISIBLE_DEVICES']} {mask_command(server.argv)}"
        log_file.write(f"# {stamp} datagen: {note} {server.name}: {shown}\n".encode())
        log_file.flush()
        logger.info("%s %s: %s (log %s)", note, server.name, shown, log_path)
        server.endpoint = None
        server.log_file = log_file
        server.log_offset = log_file.tell()
        server.proc = subprocess.Popen(
            server.argv,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=server.env,
            start_new_session=True,  # own process group: teardown reaches SGLang's scheduler children too
        )
        self._write_record()

    def _write_record(self) -> None:
        """Record the servers now running (see reap_orphaned_servers); no record when none runs."""
        me = os.getpid()
        with self._record_lock:
            servers = {
                s.name: {"pid": s.proc.pid, "start": _start_ticks(s.proc.pid), "url": s.url}
                for s in self._servers
                if s.proc is not None
            }
            if not servers:
                self._record_path.unlink(missing_ok=True)
                return
            record = {"owner": {"pid": me, "start": _start_ticks(me)}, "servers": servers}
            self._record_path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self._record_path.with_suffix(".tmp")
            tmp.write_text(json.dumps(record, indent=1))
            os.replace(tmp, self._record_path)

    def _stop_server(self, server: _Server) -> None:
        proc, server.proc = server.proc, None
        server.endpoint = None
        if proc is not None:
            stop_process_group(proc, self.stop_grace_s)
            self._write_record()
        if server.log_file is not None:
            server.log_file.close()
            server.log_file = None

    def _wait_all(self, servers: list[_Server], timeout_s: float) -> None:
        abort = threading.Event()  # the first failure stops the others' waiting
        errors: list[BaseException] = []

        def wait(server: _Server) -> None:
            try:
                self._wait_ready(server, timeout_s, abort)
            except BaseException as exc:
                errors.append(exc)
                abort.set()

        with ThreadPoolExecutor(max_workers=max(1, len(servers))) as pool:
            list(pool.map(wait, servers))
        real = [e for e in errors if not isinstance(e, _Aborted)]
        if real:
            first = real[0]
            if len(real) > 1 and isinstance(first, ServerStartError):
                others = ", ".join(e.name for e in real[1:] if isinstance(e, ServerStartError))
                first.args = (f"{first.args[0]}\n(also failed: {others})",)
            raise first

    def _wait_ready(self, server: _Server, timeout_s: float, abort: threading.Event) -> None:
        self._wait_healthy(server, timeout_s, abort)
        if server.plan is not None and server.plan.launched is not None:
            self._check_pools(server, timeout_s, abort)

    def _logged_pools(self, server: _Server) -> LoggedPools | None:
        """The pools this launch of `server` logged (its lines after log_offset); None if the log has none."""
        if server.log_path is None:
            return None
        deadline = time.monotonic() + _POOL_LOG_WAIT_S
        while True:
            try:
                with open(server.log_path, "rb") as f:
                    f.seek(server.log_offset)
                    text = f.read().decode("utf-8", "replace")
            except OSError:
                text = ""
            logged = LoggedPools.parse(text)
            if logged is not None or time.monotonic() > deadline:
                return logged
            time.sleep(_POLL_S)

    def _check_pools(self, server: _Server, timeout_s: float, abort: threading.Event) -> None:
        """The engine's logged pools against the plan; one relaunch with the plan recalibrated from them if short."""
        plan = server.plan
        assert plan is not None and plan.launched is not None
        logged = self._logged_pools(server)
        if logged is None:
            logger.warning("server %s: no memory pool lines in its log; the plan's pools are not checked", server.name)
            return
        server.pools = logged
        short = pool_shortfall(plan.launched, logged, self.pool_tolerance)
        if short is None:
            logger.info("server %s pools as planned: %s", server.name, logged.describe())
            return
        launched_args = [*self._plan_args_of(server.index), *self.spec.server_args]
        if server.recalibrated or plan.model is None:
            # Already relaunched with a recalibrated plan (or nothing to recalibrate from): fail with the numbers.
            raise PoolShortError(
                server.name,
                f"memory pools short of the plan ({short}); the engine logged {logged.describe()}; "
                f"flags {' '.join(launched_args) or '(defaults)'}",
                server.log_path,
                [],
            )
        with self._launch_lock:
            # The first server to fall short recalibrates the fleet's plan; later restarts and the other servers
            # use the new flags. A server that finds it recalibrated already takes it as it is.
            if self.memory_plan is plan:
                try:
                    self.memory_plan = plan.recalibrated(logged, launched_args)
                except ValueError as exc:
                    raise PoolShortError(
                        server.name, f"memory pools short of the plan ({short}); no recalibrated plan: {exc}", None, []
                    ) from exc
                self.plan_args = list(self.memory_plan.plan_args)
            new = self.memory_plan
        assert new is not None
        logger.warning(
            "server %s: %s; relaunching with the plan recalibrated from the engine's log: %s",
            server.name,
            short,
            " ".join(new.plan_args) or "(defaults)",
        )
        server.recalibrated = True
        server.plan = new
        server.argv = server_command(
            self.settings, self.spec, server.index, self._key_config, server.nccl_port, new.plan_args
        )
        self._stop_server(server)
        self._launch(server, note="relaunching (recalibrated memory plan)")
        self._wait_healthy(server, timeout_s, abort)
        self._check_pools(server, timeout_s, abort)

    def _wait_healthy(self, server: _Server, timeout_s: float, abort: threading.Event) -> None:
        parts = urlsplit(server.url)
        host, port = parts.hostname or "127.0.0.1", parts.port or 80
        deadline = time.monotonic() + timeout_s
        last = "port closed"
        with httpx.Client(base_url=server.url, timeout=httpx.Timeout(_HEALTH_TIMEOUT_S, connect=5.0)) as http:
            while True:
                if abort.is_set():
                    raise _Aborted(server.name)
                proc = server.proc
                if proc is not None and proc.poll() is not None:
                    raise self._failure(server, f"exited with code {proc.returncode} during startup")
                if time.monotonic() > deadline:
                    raise self._failure(server, f"did not become healthy within {timeout_s:.0f} s ({last})")
                if not _port_open(host, port):
                    time.sleep(_POLL_S)
                    continue
                try:
                    status = http.get("/health").status_code
                except httpx.HTTPError as exc:
                    last = f"/health: {type(exc).__name__}"
                    time.sleep(_POLL_S)
                    continue
                if status == 200:
                    break
                last = f"port open, /health answers {status}"
                time.sleep(_POLL_S)
            headers = {"Authorization": f"Bearer {self._api_key.get_secret_value()}"}
            try:
                resp = http.get("/server_info", headers=headers)
            except httpx.HTTPError as exc:
                raise self._failure(server, f"is healthy but /server_info failed: {exc}") from exc
        if resp.status_code != 200:
            hint = " (API key mismatch?)" if resp.status_code in (401, 403) else ""
            raise self._failure(server, f"is healthy but /server_info answered {resp.status_code}{hint}")
        info = resp.json()
        info = info if isinstance(info, dict) else {}
        version = info.get("version")
        if isinstance(version, str):
            self.engine_version = version
        server.endpoint = ServerEndpoint(
            name=server.name,
            url=server.url,
            api_key=self._api_key,
            max_running_requests=_read_capacity(info),
            log_path=str(server.log_path) if server.log_path else None,
        )
        server.ready_at = time.monotonic()
        logger.info(
            "server %s ready at %s (max running requests %s)",
            server.name,
            server.url,
            server.endpoint.max_running_requests,
        )

    def _failure(self, server: _Server, reason: str) -> ServerStartError:
        # SGLang logs its settings, API key included, at startup: the tail is masked before anyone sees it.
        tail = redact_lines(log_tail(server.log_path), [self._api_key]) if server.log_path else []
        return ServerStartError(server.name, redact_text(reason, [self._api_key]), server.log_path, tail)


class _Aborted(Exception):
    """A server's wait ended because another server failed first."""
