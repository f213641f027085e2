"""Runs ``sglang_storage.py`` and then ``sglang_controller.py`` in one SGLang process.

Usage: sglang_hicache.py STORAGE_SOCKET CONTROLLER_SOCKET (run by tests/engines_sglang.rs in
the SGLang venv, the source package on PYTHONPATH). Importing torch and SGLang is most of
either script's cost (about 25 CPU-seconds each); here it is paid once. Each script runs
unchanged, as ``__main__``, with its own daemon's socket as ``argv[1]``, and its output
follows a line ``== SCRIPT``, so the test checks each script's lines (its ``OK done``
included) on their own. The storage script runs first: it leaves no process-wide state
behind (its backends are closed), while the controller script fixes SGLang's parallel
state and, where SGLang's native page hash does not build, its page hash function for the
rest of the process. The controller's daemon-down case (``sglang_controller.py SOCKET
down``) needs a process that starts with no daemon and is not run here.
"""

import runpy
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

for name, socket in (("sglang_storage.py", sys.argv[1]), ("sglang_controller.py", sys.argv[2])):
    print(f"== {name}", flush=True)
    sys.argv = [str(HERE / name), socket]
    runpy.run_path(str(HERE / name), run_name="__main__")
