"""Build hook of the `kvtier` package: compiles the Rust cdylib and ships it inside.

`build_py` runs `cargo rustc --profile engine --lib --no-default-features --crate-type cdylib`
at the repository root (the directory above this one) and copies
`target/engine/libkvtier.so` into the built `kvtier/` package, so the wheel carries the
library it wraps and an installed package needs no library path. That is the engine build:
the client, the C ABI and the cxx bridge without the daemon's code and dependencies (cargo
feature `daemon`), a cdylib alone with fat LTO and one codegen unit (profile `engine` in
Cargo.toml). The wheel is tagged for the platform, since the
library is native code.

`KVTIER_CARGO_FEATURES` adds engine-side cargo features to that build, comma-separated
(`cuda` for engines that register GPU tensors, `mooncake-c`).

`KVTIER_PREBUILT_LIB` names an already built `libkvtier.so` to ship instead of running
cargo (a packager that built it separately, or a build machine without a Rust toolchain).
`CARGO_TARGET_DIR` is honoured as cargo honours it.
"""

import os
import shutil
import subprocess
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
LIB = "libkvtier.so"
# The cargo profile of the engine build; its output folder under the target directory.
PROFILE = "engine"


def built_library():
    """The path of a freshly built libkvtier.so."""
    prebuilt = os.environ.get("KVTIER_PREBUILT_LIB")
    if prebuilt:
        path = Path(prebuilt)
        if not path.is_file():
            raise SystemExit(f"KVTIER_PREBUILT_LIB={prebuilt} is not a file")
        return path
    manifest = ROOT / "Cargo.toml"
    if not manifest.is_file():
        raise SystemExit(
            f"{manifest} not found: the kvtier package is built from the kvtier repository "
            "(pip install ./python at its root), or set KVTIER_PREBUILT_LIB"
        )
    cargo = os.environ.get("CARGO", "cargo")
    # `cargo rustc --crate-type cdylib`: without the rlib beside it, LTO may internalize every
    # function the C ABI does not reach, so neither its code nor its exception tables remain.
    cmd = [cargo, "rustc", "--profile", PROFILE, "--lib", "--no-default-features", "--crate-type", "cdylib"]
    cmd += ["--manifest-path", str(manifest)]
    features = os.environ.get("KVTIER_CARGO_FEATURES", "").strip()
    if features:
        cmd += ["--features", features]
    try:
        subprocess.run(cmd, check=True)
    except FileNotFoundError:
        raise SystemExit("cargo is not on PATH: install a Rust toolchain, or set KVTIER_PREBUILT_LIB")
    target = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
    if not target.is_absolute():
        target = ROOT / target
    path = target / PROFILE / LIB
    if not path.is_file():
        raise SystemExit(f"cargo finished but {path} does not exist")
    return path


class BuildPy(build_py):
    """Builds the pure-Python files, then adds the native library next to them."""

    def run(self):
        super().run()
        dest = Path(self.build_lib) / "kvtier" / LIB
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(built_library(), dest)


try:  # setuptools >= 70.1 carries bdist_wheel itself
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:
    from wheel.bdist_wheel import bdist_wheel


class Wheel(bdist_wheel):
    """Tags the wheel ``py3-none-<platform>``: the library is native, but it is loaded with
    ctypes, so any Python 3 on the platform can use it."""

    def get_tag(self):
        _, _, plat = super().get_tag()
        return "py3", "none", plat


class NativeDistribution(Distribution):
    """Marks the wheel as platform-specific: it carries a native library."""

    def has_ext_modules(self):
        return True


setup(cmdclass={"build_py": BuildPy, "bdist_wheel": Wheel}, distclass=NativeDistribution)
