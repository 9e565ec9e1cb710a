"""PID 1 of a systemd lab host, before it becomes systemd (runs inside `unshare --mount --uts
--pid --ipc --cgroup --fork --propagation private`).

Why a root of its own: systemd at boot runs systemd-tmpfiles, which empties /tmp and rewrites
parts of /run and /var of whatever root it sees; on the machine's shared root it has emptied
the machine's /tmp. So this host never sees that root writable:

* / is an overlay: the machine's / as the read-only lower, the host's own upper dir on top
  (every write, every deletion lands there), and /root likewise with the lab's base layer
  (the venv with SGLang, the model configs) between;
* /tmp, /var/tmp, /run and /dev are fresh tmpfs; /var/cache/sglfleet (the lab's own state, the upper
  dir included) is hidden under an empty tmpfs;
* /proc is the new pid namespace's, with /proc/sys and /proc/sysrq-trigger read-only (the
  network namespace, and so its sysctls, is the machine's), /sys is read-only, and the cgroup2
  mount shows only this host's cgroup (cgroup namespace);

then it pivots into that root, drops the old one, and execs systemd with `container=` set (as
systemd-nspawn does), booting `sglfleet-lab.target` only. Stdlib only.

    systemd_boot.py CONFIG.json
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

SYSTEMD = "/lib/systemd/systemd"
DEVICES = ("null", "zero", "full", "random", "urandom", "tty")


def mount(*argv: str) -> None:
    subprocess.run(["mount", *argv], check=True)


def build_root(config: dict) -> str:
    root = config["root"]
    lower = ":".join(config["lower"])
    mount("-t", "overlay", "overlay", "-o",
          f"lowerdir={lower},upperdir={config['upper']},workdir={config['work']}", root)
    # The base layer's directories (/root with the venv and models) on top: overlayfs refuses
    # lower layers nested in each other, and the base sits under /, so each gets its own overlay.
    for layer in config["overlays"]:
        mount("-t", "overlay", "overlay", "-o",
              f"lowerdir={':'.join(layer['lower'])},upperdir={layer['upper']},workdir={layer['work']}",
              os.path.join(root, layer["target"]))
    for target, options in (("tmp", "mode=1777"), ("var/tmp", "mode=1777"), ("run", "mode=755"),
                            ("var/cache/sglfleet", "mode=755")):
        os.makedirs(os.path.join(root, target), exist_ok=True)
        mount("-t", "tmpfs", "-o", f"{options},nosuid,nodev", "tmpfs", os.path.join(root, target))
    mount("-t", "proc", "proc", os.path.join(root, "proc"))
    for path in ("proc/sys", "proc/sysrq-trigger"):  # the shared kernel's knobs stay read-only
        if not os.path.exists(os.path.join(root, path)):  # no sysrq in some kernels
            continue
        mount("--bind", os.path.join(root, path), os.path.join(root, path))
        mount("-o", "remount,bind,ro", os.path.join(root, path))
    mount("-t", "sysfs", "-o", "ro,nosuid,nodev,noexec", "sysfs", os.path.join(root, "sys"))
    mount("-t", "cgroup2", "-o", "nosuid,nodev,noexec", "cgroup2", os.path.join(root, "sys/fs/cgroup"))
    dev = os.path.join(root, "dev")
    mount("-t", "tmpfs", "-o", "mode=755,nosuid", "tmpfs", dev)
    for name in DEVICES + ("console",):
        open(os.path.join(dev, name), "w").close()
        # no console: systemd's status lines go to /dev/null, its log to journald
        mount("--bind", "/dev/" + (name if name != "console" else "null"), os.path.join(dev, name))
    os.makedirs(os.path.join(dev, "pts"))
    mount("-t", "devpts", "-o", "newinstance,ptmxmode=0666,mode=620", "devpts", os.path.join(dev, "pts"))
    os.symlink("pts/ptmx", os.path.join(dev, "ptmx"))
    os.makedirs(os.path.join(dev, "shm"))
    mount("-t", "tmpfs", "-o", "mode=1777,nosuid,nodev", "tmpfs", os.path.join(dev, "shm"))
    for fd, name in enumerate(("stdin", "stdout", "stderr")):
        os.symlink(f"/proc/self/fd/{fd}", os.path.join(dev, name))
    os.symlink("/proc/self/fd", os.path.join(dev, "fd"))
    return root


def pivot(root: str) -> None:
    old = os.path.join(root, ".oldroot")
    os.makedirs(old, exist_ok=True)
    os.chdir(root)
    subprocess.run(["pivot_root", ".", ".oldroot"], check=True)
    os.chdir("/")
    subprocess.run(["umount", "-l", "/.oldroot"], check=True)
    os.rmdir("/.oldroot")


def main() -> int:
    with open(sys.argv[1]) as fh:
        config = json.load(fh)
    if os.getpid() != 1:
        raise SystemExit("systemd_boot.py must run as PID 1 of a new pid namespace")
    socket.sethostname(config["hostname"])
    pivot(build_root(config))
    env = {"container": "sglfleet-lab", "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
    # stdout/stderr (the host's boot.log outside) keep systemd's own messages before journald
    os.execve(SYSTEMD, [SYSTEMD, "--unit=sglfleet-lab.target", "--log-target=console"], env)
    return 1


if __name__ == "__main__":
    sys.exit(main())
