"""Command line: ``python -m dflash_cupy demo [options]`` (see ``dflash_cupy.demo``) and
``python -m dflash_cupy selfcheck [--json]`` (see ``dflash_cupy.selfcheck``)."""
from __future__ import annotations

import argparse
import sys


def _parser() -> argparse.ArgumentParser:
    from .demo import add_arguments
    p = argparse.ArgumentParser(prog="python -m dflash_cupy",
                                description="DFlash drafter ring-cache tools")
    sub = p.add_subparsers(dest="command", required=True)
    add_arguments(sub.add_parser("demo", help="run the ring cache on a drafter, checked against the oracle"))
    from .selfcheck import add_arguments as selfcheck_arguments
    selfcheck_arguments(sub.add_parser("selfcheck", help="check every kernel variant on this device against "
                                                         "its reference and store the verdict caches obey"))
    return p


def demo(argv=None) -> int:
    """Run the demo; ``argv`` excludes the program name (``["demo", ...]`` or just options)."""
    from .demo import run
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "demo":
        argv = ["demo"] + argv
    return run(_parser().parse_args(argv))


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "demo":
        return demo(argv)
    if argv and argv[0] == "selfcheck":
        from .selfcheck import main as selfcheck_main
        return selfcheck_main(_parser().parse_args(argv))
    _parser().parse_args(argv)  # prints usage / errors for anything else
    return 2


if __name__ == "__main__":
    sys.exit(main())
