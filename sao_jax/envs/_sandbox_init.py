"""Sandbox launcher: runs as ``<base python> -I -S _sandbox_init.py '<json limits>'`` with the
untrusted program on stdin. Standard library only (it runs outside the project's venv).

Steps (see ``sao_jax/envs/sandbox.py`` for what each one enforces):
  1. ``unshare(NEWNS | NEWNET | NEWPID | NEWIPC | NEWUTS)``; read the program from stdin.
  2. fork; the child is PID 1 of the new PID namespace (when it exits, the kernel kills every
     process left in the namespace) and gets SIGKILL when this launcher dies.
  3. child, still root: private mounts; tmpfs over the trainer's directories (``mask``), the
     interpreter's prefix bind-mounted back read-only, a fresh size-limited tmpfs on /tmp (the
     only writable place, and the working directory), / remounted read-only, a fresh /proc.
  4. child: resource limits, no-new-privileges, drop to the run's uid (``sandbox.sandbox_uid``)
     and gid ``nogroup`` (RLIMIT_NPROC only binds a non-root user), exec ``python -I -S -B``
     on the program (``PROGRAM``, in the sandbox's own /tmp) with a scrubbed environment.
  5. PID 1 forks the program (PID 1 would ignore default-action signals such as SIGXCPU), waits
     and relays its status; the launcher does the same.
  6. launcher: waits and exits with the child's code, or 128 + signal number.
Setup failures print ``SANDBOX-SETUP-ERROR: ...`` on stderr and exit 125.
"""

import ctypes
import json
import os
import resource
import signal
import sys

# where the untrusted program is written: inside the fresh tmpfs mounted on /tmp in step 3 (the
# sandbox's own /tmp, not the host's)
PROGRAM = "/tmp/main.py"

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT = 1, 2, 4, 32
MS_BIND, MS_MOVE, MS_REC, MS_PRIVATE = 4096, 8192, 16384, 1 << 18
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                        ctypes.c_char_p]


def _check(rc, what):
  if rc != 0:
    err = ctypes.get_errno()
    raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(src, target, fstype, flags, data=None):
  enc = lambda s: None if s is None else s.encode()
  _check(_libc.mount(enc(src), enc(target), enc(fstype), flags, enc(data)),
         f"mount {target}")


def _fail(msg):
  sys.stderr.write(f"SANDBOX-SETUP-ERROR: {msg}\n")
  sys.stderr.flush()
  os._exit(125)


def _under(path, parent):
  return path == parent or path.startswith(parent.rstrip("/") + "/")


def _child(cfg, code: bytes):
  """PID 1 of the sandbox: builds the filesystem view, limits, drops privileges, execs."""
  _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PDEATHSIG)")
  prefix = os.path.realpath(cfg["prefix"])
  stage = cfg["stage"]
  _mount(None, "/", None, MS_REC | MS_PRIVATE)
  _mount(prefix, stage, None, MS_BIND | MS_REC)
  masks = [m for m in cfg["mask"] if os.path.isdir(m) and not os.path.islink(m) and m != "/tmp"]
  for m in masks:
    _mount("tmpfs", m, "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,mode=755")
  if any(_under(prefix, m) for m in masks):
    os.makedirs(prefix, exist_ok=True)
    _mount(stage, prefix, None, MS_MOVE)
    _mount(None, prefix, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
  else:
    _libc.umount2(stage.encode(), 2)
  _mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV,
         f"size={cfg['tmp_bytes']},mode=1777")
  with open(PROGRAM, "wb") as f:
    f.write(code)
  os.chmod(PROGRAM, 0o644)
  _mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY)
  _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV)
  os.chdir("/tmp")
  lim = cfg["limits"]
  resource.setrlimit(resource.RLIMIT_CPU, (lim["cpu_s"], lim["cpu_s"] + 1))
  resource.setrlimit(resource.RLIMIT_AS, (lim["memory_bytes"], lim["memory_bytes"]))
  resource.setrlimit(resource.RLIMIT_FSIZE, (lim["file_bytes"], lim["file_bytes"]))
  resource.setrlimit(resource.RLIMIT_NOFILE, (lim["open_files"], lim["open_files"]))
  resource.setrlimit(resource.RLIMIT_NPROC, (lim["processes"], lim["processes"]))
  resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
  _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
  os.setgroups([])
  os.setgid(cfg["gid"])
  os.setuid(cfg["uid"])
  # the parent-death signal is cleared when credentials change: set it again, as the unprivileged
  # uid.
  _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PDEATHSIG)")
  env = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8"}
  # The program must not be PID 1 itself: the kernel drops default-action signals (SIGXCPU of
  # the CPU limit, SIGTERM ...) sent to a namespace's init. PID 1 only waits and relays.
  pid = os.fork()
  if pid == 0:
    _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PDEATHSIG)")
    os.execve(cfg["python"], [cfg["python"], "-I", "-S", "-B", PROGRAM], env)
  _exit_like(pid)


def _exit_like(pid):
  """Waits for ``pid`` and exits with its code, or 128 + the signal that killed it."""
  _, status = os.waitpid(pid, 0)
  if os.WIFSIGNALED(status):
    os._exit(128 + os.WTERMSIG(status))
  os._exit(os.WEXITSTATUS(status))


def main():
  cfg = json.loads(sys.argv[1])
  code = sys.stdin.buffer.read()
  try:
    _check(_libc.unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS),
           "unshare")
  except OSError as e:
    _fail(f"{e} (namespaces need root or CAP_SYS_ADMIN)")
  pid = os.fork()
  if pid == 0:
    try:
      _child(cfg, code)
    except BaseException as e:  # pylint: disable=broad-except
      _fail(f"{type(e).__name__}: {e}")
  _exit_like(pid)


if __name__ == "__main__":
  main()
