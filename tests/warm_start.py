"""Scripts started from an interpreter that has already imported their libraries.

Every numbered script first imports torch, torchvision, Lightning, torchmetrics and watermark:
8 to 10 s of a 2-core CPU, before its first line of work, and the suite starts a script some
hundred times. So conftest.start_script (and run_script) asks a server process, started once per
pytest process, that imported those libraries and nothing of this project; it forks, and the
copy becomes the script's process as `python SCRIPT FLAGS` would make it:
- its own process (and session), with the test's standard streams, folder, environment and
  arguments; sys.path[0] the script's folder (a link to it followed), the script run as __main__
  (runpy), its uncaught exception, exit code, signal and exit handlers a fresh interpreter's; it ends
  after its exit handlers, without the teardown of the libraries' modules (run_as_main);
- this project's modules (run_keeping, local_utilities) imported by the script, from the copy of
  the suite it runs in, as a fresh interpreter would.

What a fork cannot make fresh is what the libraries read as they load: the environment then.
A script whose environment differs from the server's in anything but what `fits` lets differ (a test's own torch hub
cache, the hosts it reaches without a proxy, its hooks' HOOK_* settings, what a launcher or SLURM sets for a process, glibc's malloc tunables, which a copy
sets by mallopt) starts a fresh interpreter instead, as does one
a test asks to be fresh (Ctrl-C while the libraries load; conftest.YARDSTICK), and every script
where the server did not start. test_scripts.py checks that a forked run and a fresh one print,
record and save the same.

The processes a script starts (Lightning's launcher's, benchmark.py's runs, a documented command's
`python`) start as `python` does on the PATH the tests give every program, or as sys.executable,
which is that `python` in a forked copy: tests/warm_python/python, which asks this pytest process's
server for a copy the same way (as_python), where the environment fits and nothing but the standard
streams is handed over, and otherwise is the interpreter itself. Such a copy's process stands in for
its `python` whole: its signals, its exit code, its death by a signal (kill -9 of the `python`
kills the copy).

The multiprocessing module's forkserver preloads modules too, but runs a function, not a
script: its processes end with os._exit (no exit handlers, which the scripts' checkpoint lock
needs), and it gives neither the standard streams nor a program's exit codes.
"""
import contextlib
import importlib
import json
import os
import runpy
import select
import selectors
import signal
import socket
import subprocess
import sys
import time

PRELOAD = ("torch", "torchvision", "lightning", "torchmetrics", "watermark")
# What may differ from the server's environment: read when a run uses it, never as a library
# loads: a test's own torch hub cache, and the settings of the tests' hooks (sitecustomize.py),
# which are named HOOK_* wherever a test sets one, so that no list here must follow them
PER_RUN = {"TORCH_HOME", "PYTEST_CURRENT_TEST", "no_proxy", "NO_PROXY"}  # urllib reads no_proxy as it opens a URL
# PATH too: the libraries read it as they load only to look for programs no run here uses (torchmetrics: latex); a
# compiler, Lightning's srun, are looked for as a run goes
HOOK_SETTING = "HOOK_"
# What a running program adds to the environment of the processes it starts, read as a run starts, never as a library
# loads (but Lightning's and torchmetrics' rank, which `become` reads again): Lightning's launcher's address, ranks and the run's
# precision, torchrun's ranks, sizes, interpreter (PYTHON_EXEC) and TORCHELASTIC_* settings, torch.compile's cache
# folder, what a shell sets (PWD, OLDPWD, SHLVL, _), and gpu_check.sh's PYTHON
SET_AS_IT_RUNS = {"MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE", "PL_GLOBAL_SEED",
                  "RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE",
                  "ROLE_WORLD_SIZE", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "PYTHON_EXEC",
                  "LT_PRECISION", "TORCHINDUCTOR_CACHE_DIR", "PWD", "OLDPWD", "SHLVL", "_",
                  "PYTHON"}  # gpu_check.sh's interpreter, read by the shell script alone
# What SLURM sets for a job's task (slurmd, srun), read by Lightning as a run starts (SLURMEnvironment), never as a
# library loads; a copy's temporary folder is read again from its TMPDIR (become)
SET_BY_SLURM = {"ENVIRONMENT", "HOSTNAME", "TMPDIR"}
SLURM_PREFIXES = ("SLURM_", "SLURMD_", "SRUN_")
TORCHRUN_PREFIX = "TORCHELASTIC_"
# glibc's malloc tunables (benchmarks/runs.py's EXACT_MALLOC), read as the C library starts: a copy sets them as glibc's
# start-up does, by mallopt (<malloc.h>: M_TRIM_THRESHOLD -1, M_MMAP_THRESHOLD -3), which fixes each threshold as they do
MALLOPT = {"MALLOC_TRIM_THRESHOLD_": -1, "MALLOC_MMAP_THRESHOLD_": -3}
# The server's socket (conftest sets it for each pytest process), and the `python` that asks it for a copy
ADDRESS = "HOOK_WARM_START"
PYTHON = os.path.join(os.path.dirname(os.path.abspath(__file__)), "warm_python", "python")


def fits(env, server_env, loaded):
    """Whether a run in `env` can be a copy of a server started in `server_env`: the same environment wherever a
    library could read it as it loads (but what the libraries set as they loaded, `loaded`); a PYTHONPATH of its own
    (its hooks) where the server has none."""
    differs = {k for k in env.keys() | server_env.keys() if env.get(k) != server_env.get(k)}
    may_differ = PER_RUN | SET_AS_IT_RUNS | SET_BY_SLURM | MALLOPT.keys() | {"PATH"}
    if not server_env.get("PYTHONPATH"):
        may_differ |= {"PYTHONPATH"}
    prefixes = (HOOK_SETTING, TORCHRUN_PREFIX, *SLURM_PREFIXES)
    return all(k in may_differ or k.startswith(prefixes) or env.get(k) == loaded.get(k)
               for k in differs)


# -- The server: `python warm_start.py SOCKET` --------------------------------------------------
def serve(address):
    """Import the libraries, then fork one process per request. Returns only in a forked copy,
    set up as the request's script's process: the request."""
    found = dict(os.environ)
    for name in PRELOAD:
        __import__(name)
    if sys.modules["torch"].cuda.is_initialized():  # a CUDA context does not survive a fork
        sys.exit("a library initialised CUDA as it loaded: nothing can be forked from here")
    loaded = {k: v for k, v in os.environ.items() if found.get(k) != v}  # Lightning's PYTORCH_NVML_BASED_CUDA_CHECK
    import gc
    gc.freeze()  # the libraries' objects, shared with every copy, are never walked by its collector
    with contextlib.suppress(FileNotFoundError):
        os.unlink(address)  # a socket left by an earlier pytest process of the same pid
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address)
    listener.listen(16)
    parent = os.getppid()
    print("ready", flush=True)
    waiting = selectors.DefaultSelector()
    waiting.register(listener, selectors.EVENT_READ)
    while os.getppid() == parent:  # the pytest process that started it has not gone
        for key, _ in waiting.select(timeout=1):
            if key.fileobj is listener:
                conn = listener.accept()[0]
                message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
                request = json.loads(message)
                if not fits(request["env"], found, loaded):  # a `python` asking (as_python): it runs itself
                    conn.sendall(b"no\n")
                else:
                    pid = os.fork()
                    if pid == 0:
                        listener.close()
                        conn.close()
                        return become(request, fds, loaded)
                    conn.sendall(f"{pid}\n".encode())
                    waiting.register(os.pidfd_open(pid), selectors.EVENT_READ, (pid, conn))
                    if "python" in request:  # the copy dies with the `python` it stands in for
                        try:
                            waiting.register(os.pidfd_open(request["python"]), selectors.EVENT_READ, ("python", pid))
                        except ProcessLookupError:  # gone already
                            os.kill(pid, signal.SIGKILL)
                for fd in fds:
                    os.close(fd)
            elif key.data[0] == "python":  # a copy's `python` ended (killed): so does the copy, and all it started
                waiting.unregister(key.fileobj)
                os.close(key.fd)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(key.data[1], signal.SIGKILL)
            else:  # a script's process ended: its exit code, as subprocess gives it
                pid, conn = key.data
                waiting.unregister(key.fileobj)
                os.close(key.fd)
                for other in list(waiting.get_map().values()):  # its `python`, if any, is watched no more
                    if other.data and other.data[0] == "python" and other.data[1] == pid:
                        waiting.unregister(other.fileobj)
                        os.close(other.fd)
                code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
                try:
                    conn.sendall(f"{code}\n".encode())
                except OSError:  # the test stopped waiting
                    pass
                conn.close()
    sys.exit()  # the pytest process has gone: so does its server


def become(request, fds, loaded):
    """This forked copy as `python SCRIPT FLAGS` in the request's folder and environment (with what the libraries
    set in it as they loaded), the processes it starts asking for copies too (sys.executable)."""
    os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(loaded)
    os.environ.update(request["env"])
    import ctypes
    import tempfile
    tempfile.tempdir = None  # found again from TMPDIR, as at a fresh interpreter's first gettempdir()
    for name, parameter in MALLOPT.items():
        if name in os.environ:
            ctypes.CDLL(None).mallopt(parameter, int(os.environ[name]))
    from lightning.fabric.utilities.rank_zero import _get_rank, rank_zero_only
    from torchmetrics.utilities import prints
    # what Lightning and torchmetrics read as they loaded (a launcher's rank), read again, as they read it
    # (lightning/fabric/utilities/rank_zero.py, torchmetrics/utilities/prints.py)
    rank_zero_only.rank = _get_rank() or 0  # ty: ignore[missing-attribute]: set as Lightning sets it
    prints.rank_zero_only.rank = int(os.environ.get("LOCAL_RANK", 0))  # ty: ignore[missing-attribute]: likewise
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.executable = PYTHON
    sys.argv = request["argv"]
    if sys.argv[0] == "-m":  # `python -m MODULE`: its sys.argv[0] the module's file, which runpy sets
        sys.argv = ["-m", *sys.argv[2:]]
        sys.path[0] = os.getcwd()
    else:
        sys.path[0] = os.path.dirname(os.path.realpath(sys.argv[0]))  # as Python sets it: links followed
    hooks = [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if hooks:  # where a fresh interpreter puts them, and the sitecustomize there imported, as site
        sys.path[1:1] = hooks  # does at start-up (here after the libraries: the hooks patch what a
        sys.modules.pop("sitecustomize", None)  # run calls, which is there either way)
        try:
            importlib.import_module("sitecustomize")
        except ModuleNotFoundError as missing:
            if missing.name != "sitecustomize":
                raise
    return request


# -- The client: a test's side ----------------------------------------------------------------
class WarmStarts:
    """The server for one pytest process, started at its first script and stopped with it."""

    def __init__(self, env, folder):
        self.env, self.address, self.server = env, os.path.join(folder, "warm-start.sock"), None
        self.failed = False  # the server did not start: every script starts fresh

    def fits(self, env):
        """Whether a run in `env` can be forked from the server (started here at the first that
        can): the same environment wherever a library could read it as it loads; a PYTHONPATH
        of its own (its hooks) where the server has none."""
        return fits(env, self.env, {}) and self.ready()

    def ready(self):
        if self.server is None and not self.failed:
            self.server = subprocess.Popen([sys.executable, __file__, self.address], env=self.env,
                                           stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True,
                                           start_new_session=True)
            if self.server.stdout is None or self.server.stdout.readline().strip() != "ready":
                self.server.wait()
                self.server, self.failed = None, True
        return self.server is not None

    def start(self, argv, cwd, env, merged):
        """What subprocess.Popen(argv, cwd=cwd, env=env, stdout=PIPE, stderr=STDOUT if merged
        else PIPE, text=True, start_new_session=True) gives, argv being [python, SCRIPT, *FLAGS]
        (once fits(env) said yes)."""
        return Started(self.address, argv, cwd, env, merged)

    def stop(self):
        if self.server is not None:
            self.server.kill()
            self.server.wait()
            self.server = None


class Started:
    """A script's process forked by the server, as the tests use a subprocess.Popen: pid, poll,
    wait, communicate, send_signal, kill, returncode."""

    def __init__(self, address, argv, cwd, env, merged):
        self.args, self.returncode, self.pid = argv, None, None
        out_r, out_w = os.pipe()
        err_r, err_w = (None, out_w) if merged else os.pipe()
        self.conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.conn.connect(address)
        request = {"argv": [str(a) for a in argv[1:]], "cwd": str(cwd), "env": dict(env)}
        with open(os.devnull, "rb") as stdin:
            socket.send_fds(self.conn, [json.dumps(request).encode()], [stdin.fileno(), out_w, err_w])
        os.close(out_w)
        if not merged:
            os.close(err_w)
        self.streams = [out_r] + ([err_r] if err_r is not None else [])
        self.conn_fd = self.conn.fileno()
        self.read = {fd: b"" for fd in [self.conn_fd, *self.streams]}
        self.open = set(self.read)
        while self.pid is None and self.pump(None):
            pass
        if self.pid is None:
            raise RuntimeError("the warm-start server ended before it started a script")

    def pump(self, timeout):
        """Read what has come within `timeout` (None: until something comes); whether any did."""
        if not self.open:
            return False
        ready = select.select(list(self.open), [], [], timeout)[0]
        for fd in ready:
            data = os.read(fd, 1 << 16)
            self.read[fd] += data
            if not data:
                self.open.discard(fd)
                self.conn.close() if fd == self.conn_fd else os.close(fd)
        replies = self.read[self.conn_fd].split(b"\n")
        self.pid = int(replies[0]) if len(replies) > 1 else None
        self.returncode = int(replies[1]) if len(replies) > 2 else None
        return bool(ready)

    def __del__(self):
        for fd in getattr(self, "open", ()):
            self.conn.close() if fd == self.conn_fd else os.close(fd)

    def until(self, done, timeout):
        deadline = None if timeout is None else time.monotonic() + timeout
        while not done():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout, *self.texts())
            self.pump(left)

    def texts(self):
        """The output so far, as text=True gives it (universal newlines)."""
        return [self.read[fd].decode().replace("\r\n", "\n").replace("\r", "\n") for fd in self.streams]

    def poll(self):
        while self.pump(0):
            pass
        return self.returncode

    def wait(self, timeout=None):
        self.until(lambda: self.returncode is not None, timeout)
        return self.returncode

    def communicate(self, timeout=None):
        self.until(lambda: not self.open, timeout)
        texts = self.texts()
        return (texts[0], texts[1] if len(texts) > 1 else None)

    def send_signal(self, sig):
        if self.poll() is None and self.pid is not None:
            os.kill(self.pid, sig)

    def kill(self):
        self.send_signal(signal.SIGKILL)


def as_python(args):
    """`python ARGS`, run by tests/warm_python/python: a copy from this pytest process's server where ARGS name a
    script (or `-m MODULE`), nothing but the standard streams is open and the server says the environment fits; else the
    interpreter itself. This process then stands in for the copy: it hands the copy its signals, and ends as the
    copy ends (its exit code, or its signal); killed, the server kills the copy."""
    listed = [int(fd) for fd in os.listdir("/proc/self/fd")]  # the listing's own descriptor is closed by now
    handed = [fd for fd in listed if fd > 2 and is_open(fd)]
    unbuffered = args[1:] if args[:1] == ["-u"] and os.environ.get("PYTHONUNBUFFERED") else None
    args = unbuffered or args  # torchrun's `python -u SCRIPT`: a copy's streams are unbuffered as its server's are
    script = bool(args) and args[0].endswith(".py")
    module = len(args) > 1 and args[0] == "-m"
    if (script or module) and not handed and os.environ.get(ADDRESS):
        try:
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            conn.connect(os.environ[ADDRESS])
            request = {"argv": args, "cwd": os.getcwd(), "env": dict(os.environ), "python": os.getpid()}
            socket.send_fds(conn, [json.dumps(request).encode()], [0, 1, 2])
            replies = conn.makefile()
            reply = replies.readline().strip()
        except OSError:  # no server (it did not start, or has gone)
            reply = "no"
        if reply.isdigit():
            stand_in_for(int(reply), replies)
    os.execv(sys.executable, [sys.executable, *(["-u"] if unbuffered else []), *args])


def is_open(fd):
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def stand_in_for(pid, replies):
    """Hand the copy `pid` every signal this process can catch, then end as it ended (the server's reply)."""
    def hand_on(signum, _):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(signum, hand_on)
    reply = replies.readline().strip()
    code = int(reply) if reply.lstrip("-").isdigit() else 1  # no reply: the server has gone
    if code < 0:  # died by a signal: so does this process
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)


def run_as_main(request):
    """The script as `python SCRIPT` (or `python -m MODULE`) runs it, to its end as Python ends it (its exit code, its uncaught
    exception's traceback, death by SIGINT for an uncaught KeyboardInterrupt, its exit handlers), but for the
    interpreter's teardown of the libraries' modules, which nothing of a run happens in and which costs 1.5 s
    of a 2-core CPU a run (torch, Lightning): the copy ends after its exit handlers."""
    import atexit
    import traceback
    code, by_signal = 0, False
    try:
        if request["argv"][0] == "-m":
            runpy.run_module(request["argv"][1], run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 0 if stop.code is None else 1
        if not isinstance(stop.code, (int, type(None))):
            print(stop.code, file=sys.stderr)
    except KeyboardInterrupt:
        traceback.print_exc()
        by_signal = True
    except BaseException:
        traceback.print_exc()
        code = 1
    import threading
    # What Python's finalisation does first, in its order, by the private functions it calls itself
    # (only here, in the suite): threading's exit handlers (a ThreadPoolExecutor's, which tell its
    # workers to end: torch.compile's pool), then the wait for every non-daemon thread, then atexit's
    threading._shutdown()  # ty: ignore[missing-attribute]: not in typeshed, and the function Python calls as it ends
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    if by_signal:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)


if __name__ == "__main__":
    if sys.argv[1] == "--as-python":
        as_python(sys.argv[2:])
    request = serve(sys.argv[1])  # returns only in a forked copy, which is the script's process now
    run_as_main(request)
