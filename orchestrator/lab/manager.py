"""The local lab: simulated GPU hosts, each a real sshd in its own namespaces.

Host N (ct129, ct130, ...) listens on 127.0.1.N:22 and runs in its own mount, pid and
uts namespaces. A subnet holds 254 hosts; a larger lab goes on in the next ones (the 255th host
is 127.0.2.1), up to MAX_HOSTS. It sees the real filesystem, except that /root, /var/lib, /var/log and
/etc/systemd are overlays (a shared read-only base + the real directory underneath, with
a per-host upper layer) and /tmp and /var/tmp are its own. So /root/ml-env, /root/models and
the state dir (remote/hostlib.STATE_DIR) have the same paths as on a real host but differ per host.
Its PID 1 is hostinit.py (sshd and a reaper).

A systemd host (`lab up --systemd N`: the last N hosts) boots real systemd as its PID 1 instead,
in a whole root of its own (an overlay of the base and /, private /tmp, /run, /dev; see
systemd_boot.py): systemd's boot cleans /tmp, /run and /var of the root it sees, so it must
never see the machine's. Its sshd is a systemd unit; the server `deploy` starts is a unit too,
logging to journald.

State lives in SGLFLEET_LAB_DIR (default /var/cache/sglfleet/lab). That directory must not
sit under an overlaid path (overlayfs refuses layers nested in each other), which is
why it is not ~/.cache.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

from ..errors import ConfigError, SglfleetError
from . import base as lab_base

FIRST_HOST_NUMBER = 129
HOSTS_PER_SUBNET = 254
MAX_HOSTS = 8 * HOSTS_PER_SUBNET  # the scale benchmark's 1,000 need four subnets
SSHD = "/usr/sbin/sshd"
HOSTINIT = Path(__file__).with_name("hostinit.py")
SYSTEMD_BOOT = Path(__file__).with_name("systemd_boot.py")
SYSTEMD = "/lib/systemd/systemd"
# Booted by a systemd host: sysinit (journald, tmpfiles, ...) and the lab's sshd, nothing else.
SYSTEMD_TARGET = "sglfleet-lab.target"
# Units a systemd host never starts (masked in its root): they reach the network (NTP, apt),
# or change the kernel every lab host and the machine share (sysctl, modules, binfmt, mounts
# of kernel file systems), or are the machine's own sshd on 0.0.0.0:22.
SYSTEMD_MASKED = (
    "systemd-timesyncd.service", "apt-daily.timer", "apt-daily-upgrade.timer", "networking.service",
    "systemd-networkd.service", "systemd-resolved.service", "systemd-sysctl.service",
    "systemd-modules-load.service", "systemd-binfmt.service", "proc-sys-fs-binfmt_misc.automount",
    "kmod-static-nodes.service", "systemd-pstore.service", "systemd-firstboot.service",
    "systemd-repart.service", "sys-kernel-config.mount", "sys-kernel-debug.mount", "sys-kernel-tracing.mount",
    "sys-fs-fuse-connections.mount", "dev-hugepages.mount", "ssh.service", "ssh.socket", "sshd.service",
    "getty.target", "console-getty.service", "postgresql.service", "e2scrub_reap.service",
)
# On lab hosts the server is the stand-in (no GPU, no weights): it validates the argv with the
# real SGLang and serves SGLang's HTTP API (see sim_server.py). The launch script says so.
SIM_SERVER = "/usr/local/bin/sglfleet-sim-server"
SIM_SERVER_LABEL = "LAB SIMULATION: sglfleet-sim-server stands in for python -m sglang.launch_server"

# Per-host overlay targets; each is lower = [base copy if any, the real directory].
OVERLAY_TARGETS = ("/root", "/var/lib", "/var/log", "/etc/systemd", "/usr/local/bin")


def default_state_dir() -> Path:
    return Path(os.environ.get("SGLFLEET_LAB_DIR", "/var/cache/sglfleet/lab"))


def host_name(index: int) -> str:
    return f"ct{FIRST_HOST_NUMBER + index}"


def default_subnet() -> str:
    """The first three octets of the lab's addresses; tests use their own (SGLFLEET_LAB_SUBNET)."""
    return os.environ.get("SGLFLEET_LAB_SUBNET", "127.0.1")


def host_address(index: int, subnet: str = "127.0.1") -> str:
    """Host `index`'s address: .1 to .254 of the subnet, then of the subnets after it."""
    prefix, third = subnet.rsplit(".", 1)
    return f"{prefix}.{int(third) + index // HOSTS_PER_SUBNET}.{index % HOSTS_PER_SUBNET + 1}"


@dataclass
class LabHost:
    name: str
    address: str
    port: int
    unshare_pid: int
    gpu: str = "h200"
    kind: str = "plain"   # "plain" (hostinit.py as PID 1) or "systemd" (systemd as PID 1)


@dataclass
class HostStatus:
    name: str
    address: str
    running: bool
    sshd: bool
    init_pid: int | None
    kind: str = "plain"


class Lab:
    def __init__(self, state_dir: Path | None = None, inventory_path: Path | None = None,
                 subnet: str | None = None, cgroup: bool = False):
        """`cgroup`: plain hosts run in one cgroup of the lab's own (`cpu_seconds`: what the hosts
        cost this machine's cores, for the benchmarks), when this machine has cgroup v2."""
        self.state_dir = Path(state_dir or default_state_dir())
        resolved = self.state_dir.resolve()
        for shadowed in OVERLAY_TARGETS + ("/tmp",):
            if resolved == Path(shadowed) or Path(shadowed) in resolved.parents:
                raise SglfleetError(f"lab state dir {self.state_dir} is under {shadowed}, which every lab "
                                    f"host replaces with its own copy; choose another SGLFLEET_LAB_DIR "
                                    f"(default /var/cache/sglfleet/lab)")
        self.subnet = subnet or default_subnet()
        if not re.fullmatch(r"127\.\d{1,3}\.\d{1,3}", self.subnet) or int(self.subnet.split(".")[1]) > 255 \
                or int(self.subnet.split(".")[2]) > 255:
            raise SglfleetError(f"lab subnet must look like 127.X.Y (loopback only), got '{self.subnet}'")
        self.cgroup = _cgroup2_mount() is not None and cgroup
        self.inventory_path = Path(inventory_path or Path("inventory") / "lab.yaml")
        self.known_hosts_path = self.inventory_path.with_suffix(".known_hosts")
        self.key_path = self.state_dir / "id_ed25519"
        self.state_file = self.state_dir / "lab.json"

    # ------------------------------------------------------------ state

    def hosts(self) -> list[LabHost]:
        if not self.state_file.exists():
            return []
        data = json.loads(self.state_file.read_text())
        return [LabHost(**h) for h in data["hosts"]]

    def _save(self, hosts: list[LabHost]) -> None:
        self.state_file.write_text(json.dumps({"hosts": [asdict(h) for h in hosts]}, indent=2))

    def host_dir(self, name: str) -> Path:
        return self.state_dir / "hosts" / name

    @staticmethod
    def init_pid(host: LabHost) -> int | None:
        """The host's PID 1, as seen from here (the child of the unshare process)."""
        try:
            children = Path(f"/proc/{host.unshare_pid}/task/{host.unshare_pid}/children").read_text().split()
        except OSError:
            return None
        return int(children[0]) if children else None

    # ------------------------------------------------------------ up / down

    def check_prerequisites(self) -> None:
        if os.geteuid() != 0:
            raise SglfleetError("the lab needs root (namespaces and overlay mounts); run as root")
        if not os.path.exists(SSHD):
            raise SglfleetError(f"{SSHD} not found: install openssh-server "
                                "(`apt-get install openssh-server`; `make test` does this)")
        if shutil.which("unshare") is None:
            raise SglfleetError("`unshare` not found: install util-linux")

    def up(self, count: int = 4, gpu: str = "h200", extra_vars: dict | None = None,
           systemd: int = 0) -> list[LabHost]:
        """Start hosts ct129.. up to `count`; hosts already running are left alone. The last
        `systemd` of them boot systemd (a host already running keeps its kind). `extra_vars`
        go into the inventory's `all` vars (e.g. the lab router's sglfleet_router_url)."""
        if not 1 <= count <= MAX_HOSTS:
            raise ConfigError(f"--hosts must be between 1 and {MAX_HOSTS}, got {count}")
        last_subnet = int(self.subnet.rsplit(".", 1)[1]) + (count - 1) // HOSTS_PER_SUBNET
        if last_subnet > 255:
            raise ConfigError(f"{count} lab hosts from subnet {self.subnet} would need subnets up to "
                              f"{self.subnet.rsplit('.', 1)[0]}.{last_subnet}; choose a lower third number "
                              f"(each subnet holds {HOSTS_PER_SUBNET} hosts)")
        if not 0 <= systemd <= count:
            raise ConfigError(f"--systemd must be between 0 and --hosts ({count}), got {systemd}")
        self.check_prerequisites()
        if systemd:
            self.check_systemd_prerequisites()
        self.state_dir.mkdir(parents=True, exist_ok=True)
        base = lab_base.ensure_base()
        self._ensure_client_key()
        Path("/run/sshd").mkdir(parents=True, exist_ok=True)  # sshd's privilege-separation dir
        if self.cgroup:
            self.cgroup_path.mkdir(exist_ok=True)

        running = {h.name: h for h in self.hosts() if self.init_pid(h) is not None}
        hosts: list[LabHost] = []
        started: list[LabHost] = []
        for index in range(max(count, len(running))):
            name = host_name(index)
            if name in running:
                if running[name].address != host_address(index, self.subnet):
                    raise SglfleetError(f"the lab in {self.state_dir} runs on {running[name].address}, "
                                        f"not subnet {self.subnet}; run `sglfleet lab down` first")
                hosts.append(running[name])
                continue
            if index >= count - systemd:
                host = self._start_systemd_host(index, base, gpu)
            else:
                host = self._start_host(index, base, gpu)
            hosts.append(host)
            started.append(host)
        self._save(hosts)
        self._wait_ready(started)
        self._write_inventory(hosts, extra_vars)
        self._add_server_vars(hosts)
        return hosts

    def _add_server_vars(self, hosts: list[LabHost]) -> None:
        """What a lab host's server needs on top of the inventory `_write_inventory` wrote:
        its own bind address (hosts share one network namespace: 0.0.0.0 would take the port on
        every lab address) and the stand-in that runs instead of SGLang's launch_server."""
        text = self.inventory_path.read_text()
        header = "".join(line for line in text.splitlines(True) if line.startswith("#"))
        doc = yaml.safe_load(text)
        for host in hosts:
            entry = doc["all"]["hosts"].setdefault(host.name, {}) or {}
            entry.update(sglfleet_server_bind=host.address, sglfleet_server_command=[SIM_SERVER],
                         sglfleet_server_command_label=SIM_SERVER_LABEL)
            doc["all"]["hosts"][host.name] = entry
        self.inventory_path.write_text(header + yaml.safe_dump(doc, sort_keys=False))

    def check_systemd_prerequisites(self) -> None:
        if not os.path.exists(SYSTEMD):
            raise SglfleetError(f"{SYSTEMD} not found: a systemd lab host needs systemd installed on this "
                                "machine (its root is an overlay of this one); `apt-get install systemd`")
        if _cgroup2_mount() is None:
            raise SglfleetError("a systemd lab host needs a cgroup2 file system (systemd runs its units in "
                                "cgroups); none is mounted here (see /proc/self/mountinfo)")

    def _ensure_client_key(self) -> None:
        if not self.key_path.exists():
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "sglfleet-lab",
                            "-f", str(self.key_path)], check=True)
        shutil.copyfile(f"{self.key_path}.pub", self.state_dir / "authorized_keys")

    def _start_host(self, index: int, base: Path, gpu: str) -> LabHost:
        name, address = host_name(index), host_address(index, self.subnet)
        hdir = self.host_dir(name)
        if hdir.exists():  # leftovers of a host that died: start clean
            shutil.rmtree(hdir)
        hdir.mkdir(parents=True)
        host_key = hdir / "ssh_host_ed25519_key"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"{name}-lab",
                        "-f", str(host_key)], check=True)
        (hdir / "sshd_config").write_text(_sshd_config(address, host_key, self.state_dir / "authorized_keys",
                                                          hdir / "sshd.pid"))
        # The GPU this host declares, read by the nvidia-smi and server stand-ins.
        declared = hdir / "upper" / "var_lib" / "sglfleet-lab"
        declared.mkdir(parents=True)
        (declared / "gpu").write_text(f"{gpu} 1\n")
        # A plain host sees this machine's /var/cache as it is (not one of OVERLAY_TARGETS), so its
        # stand-in can share validation records with the other hosts'; a systemd host's root is
        # an overlay of its own, where a write would stay on that host: it keeps its records.
        (declared / "shared-records").write_text(f"{lab_base.shared_records_dir()}\n")
        lab_base.install_tools(hdir / "upper" / "usr_local_bin", gpu)
        overlays = []
        for target in OVERLAY_TARGETS:
            Path(target).mkdir(parents=True, exist_ok=True)
            slug = target.strip("/").replace("/", "_")
            lower = [str(p) for p in (base / target.lstrip("/"),) if p.is_dir()] + [target]
            overlays.append({"target": target, "lower": lower,
                             "upper": str(hdir / "upper" / slug), "work": str(hdir / "work" / slug)})
        config = {
            "hostname": name, "address": address, "port": 22, "sshd": SSHD,
            "sshd_config": str(hdir / "sshd_config"), "sshd_log": str(hdir / "sshd.log"),
            "ready_file": str(hdir / "ready"), "overlays": overlays,
            "binds": [{"source": str(hdir / "tmp"), "target": "/tmp", "mode": 0o1777},
                      {"source": str(hdir / "var_tmp"), "target": "/var/tmp", "mode": 0o1777}],
        }
        (hdir / "init.json").write_text(json.dumps(config, indent=2))
        log = open(hdir / "init.log", "ab")
        procs = self.cgroup_path / "cgroup.procs"
        proc = subprocess.Popen(
            ["unshare", "--mount", "--uts", "--pid", "--fork", "--mount-proc", "--kill-child", "--",
             sys.executable, str(HOSTINIT), str(hdir / "init.json")],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
            # in /, as an init starts: `in_host` (nsenter -w) runs knobs in init's directory, and the
            # caller's may not exist in the host (a checkout under /tmp: the host's /tmp is its own,
            # and pyenv's python3 shim refused to start there, failing test_doctor's listener in CI)
            cwd="/", preexec_fn=(lambda: procs.write_text(str(os.getpid()))) if self.cgroup else None)
        log.close()
        return LabHost(name=name, address=address, port=22, unshare_pid=proc.pid, gpu=gpu)

    def _start_systemd_host(self, index: int, base: Path, gpu: str) -> LabHost:
        """Boot systemd as the host's PID 1 in a root of its own (systemd_boot.py). The host's
        files (units, sshd config and keys, the stand-ins) are written into its upper layer."""
        name, address = host_name(index), host_address(index, self.subnet)
        hdir = self.host_dir(name)
        if hdir.exists():
            shutil.rmtree(hdir)
        upper = hdir / "upper" / "rootfs"
        etc = upper / "etc" / "sglfleet-lab"
        etc.mkdir(parents=True)
        host_key = hdir / "ssh_host_ed25519_key"  # the controller's known_hosts reads the .pub here
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"{name}-lab",
                        "-f", str(host_key)], check=True)
        for suffix in ("", ".pub"):
            shutil.copyfile(f"{host_key}{suffix}", etc / f"ssh_host_ed25519_key{suffix}")
        (etc / "ssh_host_ed25519_key").chmod(0o600)
        shutil.copyfile(self.state_dir / "authorized_keys", etc / "authorized_keys")
        (etc / "sshd_config").write_text(_sshd_config(address, Path("/etc/sglfleet-lab/ssh_host_ed25519_key"),
                                                      Path("/etc/sglfleet-lab/authorized_keys"), None))
        declared = upper / "var" / "lib" / "sglfleet-lab"
        declared.mkdir(parents=True)
        (declared / "gpu").write_text(f"{gpu} 1\n")
        lab_base.install_tools(upper / "usr" / "local" / "bin", gpu)
        units = upper / "etc" / "systemd" / "system"
        units.mkdir(parents=True)
        (units / SYSTEMD_TARGET).write_text(
            "[Unit]\nDescription=sglfleet lab host (sysinit and sshd only)\n"
            "Requires=sysinit.target sockets.target sglfleet-lab-sshd.service\n"
            "After=sysinit.target sockets.target\nAllowIsolate=yes\n")
        (units / "sglfleet-lab-sshd.service").write_text(
            f"[Unit]\nDescription=sshd of the sglfleet lab host {name} ({address}:22)\n"
            "[Service]\nExecStart=/usr/sbin/sshd -D -e -f /etc/sglfleet-lab/sshd_config\n"
            "RuntimeDirectory=sshd\nRestart=on-failure\n")
        for unit in SYSTEMD_MASKED:
            (units / unit).symlink_to("/dev/null")
        (upper / "etc" / "hostname").write_text(name + "\n")
        root = hdir / "root"
        root.mkdir()
        config = {"hostname": name, "root": str(root), "lower": ["/"], "upper": str(upper),
                  "work": str(hdir / "work" / "rootfs"),
                  "overlays": [{"target": "root", "lower": [str(base / "root"), "/root"],
                                "upper": str(hdir / "upper" / "root"), "work": str(hdir / "work" / "root")}]}
        for d in ("work/rootfs", "work/root", "upper/root"):
            (hdir / d).mkdir(parents=True, exist_ok=True)
        (hdir / "boot.json").write_text(json.dumps(config, indent=2))
        cgroup = self._host_cgroup(name)
        log = open(hdir / "boot.log", "ab")
        proc = subprocess.Popen(
            ["unshare", "--mount", "--uts", "--ipc", "--pid", "--cgroup", "--fork", "--kill-child",
             "--propagation", "private", "--", sys.executable, str(SYSTEMD_BOOT), str(hdir / "boot.json")],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
            # in its own cgroup before the cgroup namespace is made: that cgroup is the host's root
            preexec_fn=lambda: (cgroup / "cgroup.procs").write_text(str(os.getpid())))
        log.close()
        return LabHost(name=name, address=address, port=22, unshare_pid=proc.pid, gpu=gpu, kind="systemd")

    @property
    def cgroup_path(self) -> Path:
        """The cgroup of this lab's plain hosts (Lab(cgroup=True))."""
        return Path(_cgroup2_mount() or "/sys/fs/cgroup") / f"sglfleet-lab-{self.subnet.replace('.', '-')}"

    def cpu_seconds(self) -> float:
        """CPU seconds (user + sys) the plain hosts of this lab have used since `up`: sshd, their
        shells and Python, whatever a command runs there."""
        stat = dict(line.split() for line in (self.cgroup_path / "cpu.stat").read_text().splitlines())
        return (int(stat["user_usec"]) + int(stat["system_usec"])) / 1e6

    def _cgroup_path(self, name: str) -> Path:
        return Path(_cgroup2_mount() or "/sys/fs/cgroup") / f"sglfleet-lab-{self.subnet.replace('.', '-')}-{name}"

    def _host_cgroup(self, name: str) -> Path:
        path = self._cgroup_path(name)
        _remove_cgroup(path)  # a host that died leaves its (empty) cgroups
        path.mkdir()
        return path

    def _power_off(self, hosts: list[LabHost], timeout: float = 30.0) -> None:
        """A clean shutdown, as `poweroff` would do it (systemd stops its units, the server drains):
        SIGRTMIN+4 to systemd. Hosts still up after `timeout` get the plain SIGKILL of down()."""
        for host in hosts:
            pid = self.init_pid(host)
            if pid is not None:
                os.kill(pid, signal.SIGRTMIN + 4)
        deadline = time.monotonic() + timeout
        for host in hosts:
            while _alive(host.unshare_pid) and time.monotonic() < deadline:
                _reap(host.unshare_pid)
                time.sleep(0.05)

    def in_host(self, name: str, argv: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
        """Run argv inside a running host's namespaces and root (for the lab's own knobs and for
        tests: `systemctl`, `journalctl`)."""
        pid = self.init_pid(self._host(name))
        if pid is None:
            raise SglfleetError(f"lab host {name} is not running")
        return subprocess.run(["nsenter", "-t", str(pid), "-m", "-u", "-i", "-p", "-C", "-r", "-w", "--", *argv],
                              capture_output=True, text=True, timeout=timeout)

    def _wait_ready(self, hosts: list[LabHost], timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        pending = list(hosts)
        while pending and time.monotonic() < deadline:
            for host in list(pending):
                ready = self.host_dir(host.name) / "ready"
                if host.kind == "systemd":
                    if _port_open(host.address, host.port):  # its sshd unit is up
                        pending.remove(host)
                    elif self.init_pid(host) is None and not _alive(host.unshare_pid):
                        log = (self.host_dir(host.name) / "boot.log").read_text(errors="replace")
                        raise SglfleetError(f"systemd lab host {host.name} exited during boot:\n{log[-4000:]}")
                    continue
                if ready.exists():
                    if ready.read_text().strip() != "ready":
                        raise SglfleetError(f"lab host {host.name}: sshd did not start; see "
                                            f"{self.host_dir(host.name) / 'sshd.log'}")
                    pending.remove(host)
                elif self.init_pid(host) is None and not _alive(host.unshare_pid):
                    log = (self.host_dir(host.name) / "init.log").read_text(errors="replace")
                    raise SglfleetError(f"lab host {host.name} exited during start:\n{log}")
            time.sleep(0.05)
        if pending:
            raise SglfleetError(f"lab hosts not ready after {timeout:.0f}s: "
                                f"{', '.join(h.name for h in pending)}")

    def _write_inventory(self, hosts: list[LabHost], extra_vars: dict | None = None) -> None:
        names = [h.name for h in hosts]
        # Ansible's connection vars (an `ansible` run against this file reaches the same hosts);
        # sglfleet's own settings carry the sglfleet_ prefix; sglfleet_lab_gpu is read by `smoke`.
        doc = {"all": {
            "vars": {"ansible_user": "root", "ansible_ssh_private_key_file": str(self.key_path),
                     "ansible_python_interpreter": "/root/ml-env/bin/python3",
                     "sglfleet_models_dir": "/root/models", "sglfleet_host_key_policy": "strict",
                     "ansible_timeout": 5, **(extra_vars or {})},
            "hosts": {h.name: {"ansible_host": h.address, "ansible_port": h.port, "sglfleet_lab_gpu": h.gpu}
                      for h in hosts},
            "children": {"gpu-fleet": {"hosts": {n: None for n in names}},
                         "lab": {"hosts": {n: None for n in names}}},
        }}
        self.inventory_path.parent.mkdir(parents=True, exist_ok=True)
        header = ("# Written by `sglfleet lab up`: simulated hosts on loopback addresses.\n"
                  "# `sglfleet lab down` removes it. Do not edit.\n")
        self.inventory_path.write_text(header + yaml.safe_dump(doc, sort_keys=False))
        lines = []
        for h in hosts:
            pub = (self.host_dir(h.name) / "ssh_host_ed25519_key.pub").read_text().split()
            lines.append(f"{h.address} {pub[0]} {pub[1]}\n")
        self.known_hosts_path.write_text("".join(lines))

    def status(self) -> list[HostStatus]:
        result = []
        for host in self.hosts():
            pid = self.init_pid(host)
            result.append(HostStatus(host.name, host.address, pid is not None,
                                     pid is not None and _port_open(host.address, host.port), pid, host.kind))
        return result

    def down(self) -> list[str]:
        """Stop every host; nothing is left: processes, mounts and namespaces go with PID 1."""
        stopped = []
        hosts = self.hosts()
        self._power_off([h for h in hosts if h.kind == "systemd"])
        inits = []
        for host in hosts:
            pid = self.init_pid(host)
            if _alive(host.unshare_pid):
                os.kill(host.unshare_pid, signal.SIGTERM)  # --kill-child: PID 1 gets SIGKILL
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
                inits.append(pid)
            stopped.append(host.name)
        # PID 1 ends only once every process of its namespace has (the kernel kills them all):
        # waiting for it, not only for unshare, returns when the host's processes are gone
        deadline = time.monotonic() + 30
        for pid in [h.unshare_pid for h in hosts] + inits:
            while _alive(pid) and time.monotonic() < deadline:
                _reap(pid)
                time.sleep(0.02)
        for host in hosts:
            if host.kind == "systemd":
                _remove_cgroup(self._cgroup_path(host.name))
        _remove_cgroup(self.cgroup_path)
        shutil.rmtree(self.state_dir / "hosts", ignore_errors=True)
        self.state_file.unlink(missing_ok=True)
        self.inventory_path.unlink(missing_ok=True)
        self.known_hosts_path.unlink(missing_ok=True)
        return stopped

    # ------------------------------------------------------------ fault knobs

    def _host(self, name: str) -> LabHost:
        for host in self.hosts():
            if host.name == name:
                return host
        raise SglfleetError(f"no lab host named '{name}' (lab hosts: "
                            f"{', '.join(h.name for h in self.hosts()) or 'none; run `sglfleet lab up`'})")

    def _signal_init(self, name: str, sig: int) -> None:
        pid = self.init_pid(self._host(name))
        if pid is None:
            raise SglfleetError(f"lab host {name} is not running")
        os.kill(pid, sig)

    def stop_sshd(self, name: str) -> None:
        host = self._host(name)
        if host.kind == "systemd":
            self._systemctl(name, "stop", "sglfleet-lab-sshd.service")
        else:
            self._signal_init(name, signal.SIGUSR1)
        _wait_port(host.address, host.port, open_=False)

    def start_sshd(self, name: str) -> None:
        host = self._host(name)
        if host.kind == "systemd":
            self._systemctl(name, "start", "sglfleet-lab-sshd.service")
        else:
            self._signal_init(name, signal.SIGUSR2)
        _wait_port(host.address, host.port, open_=True)

    def _systemctl(self, name: str, *argv: str) -> None:
        result = self.in_host(name, ["systemctl", *argv])
        if result.returncode != 0:
            raise SglfleetError(f"lab host {name}: systemctl {' '.join(argv)} failed: {result.stderr.strip()}")

    def kill_host(self, name: str) -> None:
        """SIGKILL the host's PID 1: the kernel kills everything in its pid namespace."""
        host = self._host(name)
        self._signal_init(name, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while _alive(host.unshare_pid) and time.monotonic() < deadline:
            _reap(host.unshare_pid)
            time.sleep(0.02)

    def namespaces(self, name: str) -> dict[str, str]:
        """The namespace ids (`mnt:[...]`) of a running host, for isolation checks."""
        pid = self.init_pid(self._host(name))
        if pid is None:
            return {}
        return {ns: os.readlink(f"/proc/{pid}/ns/{ns}") for ns in ("mnt", "pid", "uts")}


def _sshd_config(address: str, host_key: Path, authorized_keys: Path, pidfile: Path | None) -> str:
    return f"""# sglfleet lab host
ListenAddress {address}:22
HostKey {host_key}
PidFile {pidfile or 'none'}
AuthorizedKeysFile {authorized_keys}
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
UseDNS no
PrintMotd no
MaxStartups 200
MaxSessions 100
Subsystem sftp internal-sftp
"""


def _cgroup2_mount() -> str | None:
    """Where the cgroup2 hierarchy is mounted (/sys/fs/cgroup, or /sys/fs/cgroup/unified on a
    hybrid layout), or None."""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if " - " in line and line.split(" - ", 1)[1].split()[0] == "cgroup2":
            return fields[4]
    return None


def _remove_cgroup(path: Path) -> None:
    """Remove a dead host's cgroup tree, innermost first (a cgroup dir goes only when empty)."""
    if not path.is_dir():
        return
    for dirpath, _dirs, _files in sorted(os.walk(path), key=lambda entry: -entry[0].count("/")):
        try:
            os.rmdir(dirpath)
        except OSError:
            pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie child of ours counts as gone
        return "Z" not in Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def _port_open(address: str, port: int) -> bool:
    try:
        with socket.create_connection((address, port), timeout=0.5):
            return True
    except OSError:
        return False


def _wait_port(address: str, port: int, open_: bool, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _port_open(address, port) == open_:
            return
        time.sleep(0.05)
    raise SglfleetError(f"{address}:{port} did not become {'reachable' if open_ else 'unreachable'}")
