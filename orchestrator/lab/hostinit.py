"""PID 1 of one simulated lab host (runs inside `unshare --mount --uts --pid`).

It gives the host its own view of the per-host paths, then runs sshd and reaps orphans,
as init does on a real machine. Stdlib only: it runs under any python3.

Once sshd listens it execs, as PID 1, a reaper of a few lines of Perl (REAPER below; perl-base
is part of every Debian and Ubuntu) that keeps sshd and the signals below: an idle Python holds
~6 MiB of its own, Perl ~0.5 MiB, and a lab of 1,000 hosts holds 1,000 of them. Without
/usr/bin/perl the Python loop below stays PID 1, as before.

    hostinit.py CONFIG.json

Signals from the lab manager:
    SIGUSR1  stop sshd (the host stays up, unreachable)   -- fault knob
    SIGUSR2  start sshd again
    SIGTERM  stop everything; the kernel then tears the namespaces down
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time


def mount_overlays(config: dict) -> None:
    for mount in config["overlays"]:
        target = mount["target"]
        for d in (mount["upper"], mount["work"]):
            os.makedirs(d, exist_ok=True)
        lower = ":".join(mount["lower"])
        subprocess.run(["mount", "-t", "overlay", "overlay", "-o",
                        f"lowerdir={lower},upperdir={mount['upper']},workdir={mount['work']}", target],
                       check=True)
    for bind in config.get("binds", []):
        os.makedirs(bind["source"], exist_ok=True)
        os.chmod(bind["source"], bind.get("mode", 0o755))
        subprocess.run(["mount", "--bind", bind["source"], bind["target"]], check=True)


def sshd_argv(config: dict) -> list[str]:
    """sshd in the foreground, logging to stderr, and not re-executing itself for each connection
    (-r): the re-exec is 5 ms of this machine's CPU per connection (measured on 32 lab hosts),
    which every lab host's sshd shares with the controller under test. The SSH protocol, the
    key exchange and authentication, and the session processes are sshd's as they are on a host."""
    return [config["sshd"], "-D", "-r", "-e", "-f", config["sshd_config"]]


SIGNALS = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGINT)
PERL = "/usr/bin/perl"
# PID 1 once sshd listens: perl -e REAPER READY_FILE SSHD_LOG SSHD_PID SSHD_ARGV... The knobs of
# Init: USR1 stops sshd (TERM, KILL after 5 s), USR2 starts it again (stdout and stderr to
# SSHD_LOG), TERM/INT stop sshd and end PID 1, which takes the namespaces down. Handlers only
# queue; the loop acts, one knob at a time (a start that ran while a stop still waited for sshd
# would find it running and do nothing), and never inside a handler, whose blocked signal sshd
# would inherit. Every child is reaped, orphans included; a child's exit or a knob wakes the loop,
# and it looks at least once a second. No POSIX module: it holds ~2 MiB of its own. It writes
# READY_FILE once its handlers are in place, so no knob can come before them.
REAPER = r"""
use strict;
my ($ready, $log, $sshd, @argv) = @ARGV; my @queued;
$0 = "hostinit.py (its Perl reaper): sshd and orphans";  # what ps and /proc/1/cmdline show
sub start_sshd { return if $sshd; my $pid = fork(); return unless defined $pid;
  if ($pid == 0) { open(STDIN, "<", "/dev/null"); open(STDOUT, ">>", $log); open(STDERR, ">&", \*STDOUT);
    exec(@argv); exit 127; }
  $sshd = $pid; }
sub stop_sshd { return unless $sshd; kill("TERM", $sshd);
  for (1 .. 50) { last if waitpid($sshd, 1) != 0; select(undef, undef, undef, 0.1); }
  if (kill(0, $sshd)) { kill("KILL", $sshd); waitpid($sshd, 0); } $sshd = 0; }
$SIG{USR1} = sub { push @queued, \&stop_sshd }; $SIG{USR2} = sub { push @queued, \&start_sshd };
$SIG{TERM} = $SIG{INT} = sub { push @queued, sub { stop_sshd(); exit 0 } }; $SIG{CHLD} = sub { };
open(my $fh, ">", "$ready.partial") or die "$ready: $!"; print $fh "ready\n"; close($fh);
rename("$ready.partial", $ready) or die "$ready: $!";
while (1) {
  while (my $knob = shift @queued) { $knob->() }
  while ((my $pid = waitpid(-1, 1)) > 0) { $sshd = 0 if $sshd && $pid == $sshd }
  sleep 1 unless @queued;
}
"""


class Init:
    def __init__(self, config: dict):
        self.config = config
        self.sshd: subprocess.Popen | None = None
        self.stopping = False

    def start_sshd(self) -> None:
        if self.sshd is not None and self.sshd.poll() is None:
            return
        log = open(self.config["sshd_log"], "ab")
        self.sshd = subprocess.Popen(sshd_argv(self.config),
                                     stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        log.close()

    def stop_sshd(self) -> None:
        if self.sshd is not None and self.sshd.poll() is None:
            self.sshd.terminate()
            try:
                self.sshd.wait(5)
            except subprocess.TimeoutExpired:
                self.sshd.kill()
        self.sshd = None

    def on_signal(self, signum: int, _frame) -> None:
        if signum == signal.SIGUSR1:
            self.stop_sshd()
        elif signum == signal.SIGUSR2:
            self.start_sshd()
        else:
            self.stopping = True

    def write_ready(self, ready: bool) -> None:
        # Written aside and renamed: the manager polls for the file and reads it as soon as it
        # exists, and an open("w") shows it empty first (read as "sshd did not start" in CI).
        partial = self.config["ready_file"] + ".partial"
        with open(partial, "w") as fh:
            fh.write("ready\n" if ready else "sshd did not start\n")
        os.replace(partial, self.config["ready_file"])

    def wait_listening(self, deadline: float) -> bool:
        address = (self.config["address"], self.config["port"])
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(address, timeout=0.5):
                    return True
            except OSError:
                time.sleep(0.05)
        return False

    def serve(self) -> int:
        for sig in SIGNALS:
            signal.signal(sig, self.on_signal)
        self.start_sshd()
        ready = self.wait_listening(time.monotonic() + 20)
        if ready and os.path.exists(PERL) and not self.stopping and self.sshd is not None:
            os.execv(PERL, [PERL, "-e", REAPER, self.config["ready_file"], self.config["sshd_log"],
                            str(self.sshd.pid), *sshd_argv(self.config)])
        self.write_ready(ready)
        while not self.stopping:
            try:
                # Reap every child, including orphans re-parented to us (we are PID 1).
                pid, _status = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    time.sleep(0.2)
            except ChildProcessError:
                time.sleep(0.2)
        self.stop_sshd()
        return 0


def main() -> int:
    with open(sys.argv[1]) as fh:
        config = json.load(fh)
    socket.sethostname(config["hostname"])
    mount_overlays(config)
    return Init(config).serve()


if __name__ == "__main__":
    sys.exit(main())
