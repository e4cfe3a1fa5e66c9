"""``python -m cpattn_common build-launch-plans``: build the launch-plan module ahead of time.

Launch plans build their native module at the first op call of a process on a machine without
a cached build (in the background, about 15 s). A container image or a deployment step can
build it once instead, into ``$CPATTN_CACHE_DIR`` (else ``$XDG_CACHE_HOME/cpattn``, else
``~/.cache/cpattn``), so that every later process loads it at once. Needs a C++ compiler and torch's headers; no GPU.
"""

from __future__ import annotations

import argparse
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cpattn_common", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("build-launch-plans", help="build (or find) the launch-plan module")
    parser.parse_args(argv)

    from cpattn_common import launch_plans

    start = time.perf_counter()
    try:
        module = launch_plans._native_module()
    except Exception as exc:
        print(f"launch plans: cannot build the native module: {exc}", file=sys.stderr)
        return 1
    print(f"launch plans: {module.__file__} ({time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
