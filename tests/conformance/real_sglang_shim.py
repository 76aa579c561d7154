"""Import real SGLang 0.5.23 code without a GPU stack: stand-ins for the heavy modules it merely imports.

Loaded only inside the conformance tier's subprocesses (`RealSglang.run` / `python real_sglang_shim.py`),
never in the pytest process: the stubs must not leak into other tests. A stubbed module answers every
attribute with an inert placeholder class, so `import torch`, `torch.float16` and `class M(torch.nn.Module)`
at import time work. Placeholders are falsy and compute nothing: the tier only runs code that parses flags,
resolves settings and validates requests, and every test asserts on what that real code returned.
`torch.version` reports a CUDA 13 build and importlib.metadata the versions sglang pins (transformers asks
before it imports torch). `torch.cuda` reports no GPU, or with CONFORMANCE_GPU=sm120 one RTX PRO 6000
(SM 12.0, 97,887 MiB), which is what each of the box's servers sees, so settings resolution runs in full.

Run as a script it executes Python code read from stdin with sglang importable, and prints what the code
stores in the global `RESULT` as one JSON line after the marker `CONFORMANCE-RESULT:`. With `--script`
it acts as an engine venv's `python` (`--script FILE ARGS`, `--script -m MODULE ARGS`).
"""

from __future__ import annotations

import abc
import importlib.abc
import importlib.machinery
import importlib.metadata
import json
import os
import runpy
import sys
import traceback
import types
from collections.abc import Sequence
from typing import Any

__all__ = ["HEAVY_MODULES", "RESULT_MARKER", "install_stubs", "main", "stubbed_modules"]

RESULT_MARKER = "CONFORMANCE-RESULT:"

# Top-level packages that need CUDA or several GB of wheels; SGLang's CLI and request layers import
# them (or submodules) at module level without using them while parsing flags or requests.
HEAVY_MODULES = frozenset(
    {
        "torch",
        "torchvision",
        "torchaudio",
        "torchcodec",
        "triton",
        "flashinfer",
        "sgl_kernel",
        "sglang_kernel",
        "flash_attn",
        "flash_attn_4",
        "deep_gemm",
        "deep_ep",
        "flash_mla",
        "tilelang",
        "cuda",
        "cupy",
        "numba",
        "xgrammar",
        "llguidance",
        "outlines",
        "vllm",
        "quack",
        "cutlass",
        "nvshmem",
        "humming_kernels",
        "torch_memory_saver",
        "decord",
        "av",
        "soundfile",
        "timm",
        "pynvml",
        "apache_tvm_ffi",
        "tvm_ffi",
        "compressed_tensors",
    }
)

# Attributes a CPU-only torch lacks: SGLang's platform probes use `hasattr(torch, "npu")` and the like.
_ABSENT = frozenset({"torch.npu", "torch.musa", "torch.hpu", "torch.mlu"})
_STUB_VERSION = "2.14.1"  # what sglang 0.5.23 pins for torch; version checks read it as a string


class _PlaceholderMeta(abc.ABCMeta):
    """Metaclass of placeholders: a placeholder is a real class, so `isinstance(x, torch.dtype)` works too.

    An ABCMeta, so that `class Op(nn.Module, ABC)` finds one metaclass for both bases.
    """

    # Real classes that subclass a placeholder (`class M(torch.nn.Module)`) behave as plain classes.

    def __getattr__(cls, attr: str) -> Any:
        if (attr.startswith("__") and attr.endswith("__")) or "_conformance_stub" not in cls.__dict__:
            raise AttributeError(attr)
        child = _placeholder(f"{cls.__qualname__}.{attr}")
        type.__setattr__(cls, attr, child)
        return child

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if "_conformance_stub" not in cls.__dict__:
            return super().__call__(*args, **kwargs)
        # Decorators (`@torch.compile`, `@triton.jit`, `@torch.no_grad()`) keep the function they wrap.
        if len(args) == 1 and not kwargs and callable(args[0]) and not isinstance(args[0], _PlaceholderMeta):
            return args[0]
        return _placeholder(f"{cls.__qualname__}()")

    def __instancecheck__(cls, instance: Any) -> bool:
        # `torch.float16` is a placeholder too: one stub value counts as an instance of any stub type.
        if "_conformance_stub" in cls.__dict__ and isinstance(instance, _PlaceholderMeta):
            return "_conformance_stub" in instance.__dict__ or super().__instancecheck__(instance)
        return super().__instancecheck__(instance)

    def __getitem__(cls, item: Any) -> Any:
        if "_conformance_stub" not in cls.__dict__:
            return cls.__class_getitem__(item)  # type: ignore[attr-defined]
        return _placeholder(f"{cls.__qualname__}[]")

    def __iter__(cls) -> Any:
        if "_conformance_stub" not in cls.__dict__:
            raise TypeError(f"{cls.__qualname__} is not iterable")
        return iter(())

    def __bool__(cls) -> bool:
        # `if torch.cuda.is_available():` and friends: no accelerator here.
        return "_conformance_stub" not in cls.__dict__

    def __len__(cls) -> int:
        if "_conformance_stub" not in cls.__dict__:
            raise TypeError(f"{cls.__qualname__} has no len()")
        return 0

    def __repr__(cls) -> str:
        return f"<stub {cls.__qualname__}>"

    def __enter__(cls) -> Any:
        return cls

    def __exit__(cls, *exc: object) -> None:
        return None

    def __int__(cls) -> int:
        return 0  # module-level constants such as `int(torch.distributed.ReduceOp.SUM)`

    __index__ = __int__

    def __float__(cls) -> float:
        return 0.0

    def _arith(cls, *args: Any) -> Any:
        return _placeholder(f"({cls.__qualname__} op)")

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __rtruediv__ = _arith
    __floordiv__ = __mod__ = __pow__ = __matmul__ = __neg__ = __and__ = __rand__ = __lshift__ = _arith

    def __lt__(cls, other: Any) -> bool:
        return False

    __le__ = __gt__ = __ge__ = __lt__


class _PlaceholderBase(metaclass=_PlaceholderMeta):
    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: Any) -> Any:
        # A pydantic field typed with a stubbed class (torch.dtype, xgrammar.StructuralTag) accepts any value.
        from pydantic_core import core_schema

        return core_schema.any_schema()


def _placeholder(name: str) -> Any:
    return _PlaceholderMeta(
        name.rsplit(".", 1)[-1], (_PlaceholderBase,), {"_conformance_stub": True, "__qualname__": name}
    )


class _Library:
    """`torch.library.Library(ns, kind)`: SGLang reads `.m.name` as a string while registering custom ops."""

    def __init__(self, ns: str, kind: str = "DEF", *args: Any, **kwargs: Any) -> None:
        self.ns = ns
        self.m = types.SimpleNamespace(name=ns)

    def define(self, *args: Any, **kwargs: Any) -> None:
        return None

    def impl(self, *args: Any, **kwargs: Any) -> None:
        return None

    def _register_fake(self, *args: Any, **kwargs: Any) -> None:
        return None


# A CPU-only CUDA build of torch: SGLang's platform probes compare these with None.
_VERSION = types.ModuleType("torch.version")
_VERSION.__dict__.update(cuda="13.0", hip=None, musa=None, git_version="conformance-stub", debug=False)
_VERSION.__file__ = "<conformance stub torch.version>"


class _Cuda(types.ModuleType):
    """`torch.cuda` of the box being emulated (CONFORMANCE_GPU=sm120: one RTX PRO 6000 per server)."""

    def __init__(self, gpu: str | None) -> None:
        super().__init__("torch.cuda")
        self.__path__: list[str] = []
        self.__file__ = "<conformance stub torch.cuda>"
        self.gpu = gpu

    def is_available(self) -> bool:
        return self.gpu is not None

    def device_count(self) -> int:
        return 1 if self.gpu else 0  # CUDA_VISIBLE_DEVICES=i: one GPU per server

    def get_device_capability(self, device: Any = 0) -> tuple[int, int]:
        return (12, 0)

    def get_device_name(self, device: Any = 0) -> str:
        return "NVIDIA RTX PRO 6000 Blackwell Server Edition"

    def get_device_properties(self, device: Any = 0) -> Any:
        return types.SimpleNamespace(
            name=self.get_device_name(), major=12, minor=0, total_memory=_GPU_BYTES, multi_processor_count=188
        )

    def mem_get_info(self, device: Any = 0) -> tuple[int, int]:
        return (_GPU_BYTES - 512 * 2**20, _GPU_BYTES)

    def current_device(self) -> int:
        return 0

    def is_initialized(self) -> bool:
        return False

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return _placeholder(f"torch.cuda.{attr}")


# What an RTX PRO 6000 Blackwell reports: 97,887 MiB (nvidia-smi's memory.total, ~95.6 GiB; the GPU probe
# fixture tests/fixtures/gpu_probe_8x_sm120.json says the same). An earlier value, 97_887_535_104, read the MiB
# figure as bytes x 1e6 and emulated a card 4.4 GiB too small.
_GPU_BYTES = 97_887 * 2**20

# Attributes whose value real code uses as a plain Python value at import time.
_OVERRIDES: dict[str, Any] = {"torch.library.Library": _Library, "torch.version": _VERSION}


class _StubModule(types.ModuleType):
    """A stubbed package: every attribute is a placeholder, every submodule another stub."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.__path__: list[str] = []
        self.__version__ = _STUB_VERSION
        self.__file__ = f"<conformance stub {name}>"

    def __getattr__(self, attr: str) -> Any:
        if (attr.startswith("__") and attr.endswith("__")) or f"{self.__name__}.{attr}" in _ABSENT:
            raise AttributeError(attr)
        full = f"{self.__name__}.{attr}"
        value = _OVERRIDES[full] if full in _OVERRIDES else _placeholder(full)
        setattr(self, attr, value)
        return value


# Versions the stubs report through importlib.metadata (transformers asks before it imports torch):
# sglang 0.5.23's own pins where it has one, else the release that pairs with torch 2.14.
_DIST_VERSIONS = {
    "torch": "2.14.1",
    "torchaudio": "2.11.0",
    "torchcodec": "0.17.0",
    "torchvision": "0.29.1",
    "triton": "3.7.0",
}


class _StubDistribution(importlib.metadata.Distribution):
    def __init__(self, name: str) -> None:
        self._name = name

    def read_text(self, filename: str) -> str | None:
        if filename == "METADATA":
            return f"Metadata-Version: 2.1\nName: {self._name}\nVersion: {_DIST_VERSIONS[self._name]}\n"
        return None

    def locate_file(self, path: Any) -> Any:
        return path


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, roots: frozenset[str]) -> None:
        self.roots = roots

    def find_distributions(self, context: Any = None) -> Any:
        name = getattr(context, "name", None)
        names = _DIST_VERSIONS if name is None else [n for n in _DIST_VERSIONS if n == name.replace("-", "_")]
        return iter([_StubDistribution(n) for n in names])

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None) -> Any:
        if fullname.split(".", 1)[0] in self.roots:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        special = _OVERRIDES.get(spec.name)
        return special if isinstance(special, types.ModuleType) else _StubModule(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def install_stubs(roots: frozenset[str] = HEAVY_MODULES) -> None:
    """Put the stub finder first on sys.meta_path (this process only)."""
    gpu = os.environ.get("CONFORMANCE_GPU") or None
    if gpu not in (None, "sm120"):
        raise SystemExit(f"CONFORMANCE_GPU={gpu!r}: only 'sm120' (or unset: no GPU) is emulated")
    _OVERRIDES["torch.cuda"] = _Cuda(gpu)
    sys.meta_path.insert(0, _StubFinder(roots))


def stubbed_modules() -> list[str]:
    """Names of the stub modules imported so far."""
    return sorted(n for n, m in list(sys.modules.items()) if str(getattr(m, "__file__", "")).startswith("<conformance"))


def _run_as_python(argv: Sequence[str]) -> int:
    """`--script FILE ARGS` / `--script -m MODULE ARGS`: run it as `python` would, with the stubs installed."""
    install_stubs()
    if argv and argv[0] == "-m" and len(argv) > 1:
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    elif argv:
        sys.argv = list(argv)
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
        runpy.run_path(argv[0], run_name="__main__")
    else:
        raise SystemExit("usage: real_sglang_shim.py --script FILE|-m MODULE [ARGS]")
    return 0


def main(argv: Sequence[str]) -> int:
    """Run the code on stdin with stubs installed; print RESULT as JSON (or the exception) after the marker."""
    if argv and argv[0] == "--script":
        return _run_as_python(argv[1:])
    install_stubs()
    code = sys.stdin.read()
    scope: dict[str, Any] = {"__name__": "__conformance__", "RESULT": None, "ARGS": list(argv)}
    try:
        exec(compile(code, "<conformance snippet>", "exec"), scope)
    except BaseException as exc:  # report any failure as data; the test decides what it means
        payload = {
            "ok": False,
            "error_type": type(exc).__name__,
            "error": str(exc),
            "traceback": traceback.format_exc(),
            "stubbed": stubbed_modules(),
        }
    else:
        payload = {"ok": True, "result": scope.get("RESULT"), "stubbed": stubbed_modules()}
    sys.stdout.flush()
    print(RESULT_MARKER + json.dumps(payload, default=repr), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
