"""Hosts simulated on this machine, for tests of what crosses nodes (issue 30, part 5).

Each host is a network namespace with one interface, ``eth0`` (10.77.0.N/24), joined to the others
by a bridge in a namespace of its own, so that traffic stays inside the namespaces the test made;
its processes run in a UTS namespace (their own hostname: ``hostA``, ``hostB``, ...) and a mount
namespace where a folder of its own is mounted at one path shared by every host, its *local disk*
(``SimulatedHosts.local``), a memory of its own (a tmpfs, its ``/dev/shm``) at another such path
(``SimulatedHosts.memory``), and an ``/etc/hosts`` naming every host. A test launches ranks on each host
with ``torchrun --nnodes N`` over those addresses (``torchrun``), each launch with a timeout; the
fixture kills what is left and removes what it made.

Each host's memory is a tmpfs mounted in the test's own namespace (``Host.memory``, so the test sees
and wipes it as it does ``Host.disk``) and bound at ``SimulatedHosts.memory`` on that host: it
outlives the host's processes, as a node's /dev/shm outlives a killed job, until ``close`` unmounts
it. Where a tmpfs cannot be mounted, each host's memory is a folder under /dev/shm instead
(``SimulatedHosts.memory_is_tmpfs`` False), which ``close`` removes.

Making namespaces needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN) and iproute2's ``ip``. Where the
machine cannot, ``SimulatedHosts.start`` raises ``HostsUnavailable`` saying why: a skip outside CI,
a failure under it (``hosts`` in tests/conftest.py).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tests.support import markers
from tests.support.helpers import SCRIPTS, assert_groups_released, script_env

#: The hosts' network; the bridge has no address, so the machine's own namespace sees none of it.
SUBNET = "10.77.0"
#: torchrun's rendezvous port on the first host (each host's namespace is new: nothing else listens).
MASTER_PORT = 29500
#: libfaketime (Debian's package), which runs a host's processes on a clock of its own.
FAKETIME_LIBRARY = "/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1"


def clock_offset(seconds: float) -> dict[str, str]:
    """The variables that run a process on a clock ``seconds`` ahead of the machine's (libfaketime)."""
    return {"LD_PRELOAD": FAKETIME_LIBRARY, "FAKETIME": f"{seconds:+g}s", "FAKETIME_DONT_RESET": "1"}


class HostsUnavailable(RuntimeError):
    """This machine cannot simulate hosts (no root, no ``ip``, namespaces refused)."""


@dataclass
class Host:
    name: str
    address: str
    namespace: str
    #: The folder mounted at ``SimulatedHosts.local`` on this host only.
    disk: Path
    #: This host's memory (a tmpfs, its /dev/shm), mounted at ``SimulatedHosts.memory`` on this host only.
    memory: Path


class SimulatedHosts:
    """``count`` hosts (``hostA``, ``hostB``, ...) on this machine; ``root`` holds their folders.
    ``memory_size``: the most each host's memory (tmpfs) holds (``mount -o size=``)."""

    def __init__(self, count: int, root: Path, memory_size: str = "1g"):
        self.root = Path(root)
        tag = f"ck{os.getpid() % 100000}"
        self.switch = f"{tag}sw"
        self.hosts = [Host(f"host{chr(ord('A') + i)}", f"{SUBNET}.{i + 1}", f"{tag}h{i}", self.root / f"disk{i}",
                           self.root / f"memory{i}") for i in range(count)]
        #: The path at which each host sees its own local disk.
        self.local = self.root / "local"
        #: The path at which each host sees its own memory (a node-scoped tier there is a tier in memory).
        self.memory = self.root / "memory"
        self.memory_size = memory_size
        #: Whether each host's memory is a tmpfs of its own (False: a folder under /dev/shm, see above).
        self.memory_is_tmpfs = True
        self._mounted: list[Path] = []
        self._shm_folders: list[Path] = []
        #: A folder every host sees (the shared tier).
        self.shared = self.root / "shared"
        self._hosts_file = self.root / "etc-hosts"
        self._made: list[str] = []

    # -- making and removing ---------------------------------------------------------------------
    def start(self) -> SimulatedHosts:
        if os.geteuid() != 0:
            raise HostsUnavailable("simulated hosts need root (network, UTS and mount namespaces)")
        if shutil.which("ip") is None or shutil.which("unshare") is None:
            raise HostsUnavailable("simulated hosts need iproute2's ip and util-linux's unshare")
        for folder in (self.local, self.shared, self.memory, *(host.disk for host in self.hosts)):
            folder.mkdir(parents=True, exist_ok=True)
        self._memories()
        self._hosts_file.write_text("127.0.0.1 localhost\n"
                                    + "".join(f"{host.address} {host.name}\n" for host in self.hosts))
        try:
            self._namespace(self.switch)
            self._ip(self.switch, "link", "add", "br0", "type", "bridge")
            self._ip(self.switch, "link", "set", "br0", "up")
            for index, host in enumerate(self.hosts):
                self._namespace(host.namespace)
                port = f"p{index}"
                self._ip(host.namespace, "link", "add", "eth0", "type", "veth", "peer", "name", port,
                         "netns", self.switch)
                self._ip(host.namespace, "addr", "add", f"{host.address}/24", "dev", "eth0")
                self._ip(host.namespace, "link", "set", "eth0", "up")
                self._ip(host.namespace, "link", "set", "lo", "up")
                self._ip(self.switch, "link", "set", port, "master", "br0")
                self._ip(self.switch, "link", "set", port, "up")
        except HostsUnavailable:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Kill whatever still runs on the hosts and remove the namespaces (their links go with them)."""
        for namespace in reversed(self._made):
            pids = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
        self._made.clear()
        for mounted in reversed(self._mounted):  # lazily: a process of the test's may still hold a file there
            subprocess.run(["umount", "--lazy", str(mounted)], capture_output=True)
        self._mounted.clear()
        for folder in self._shm_folders:
            shutil.rmtree(folder, ignore_errors=True)
        self._shm_folders.clear()

    def _memories(self) -> None:
        """Each host's memory: a tmpfs mounted at ``host.memory``; where one cannot be mounted, every host's
        is a folder under /dev/shm instead, ``host.memory`` a link to it."""
        for host in self.hosts:
            host.memory.mkdir(parents=True, exist_ok=True)
            result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.memory_size},mode=0755",
                                     f"ckptfmt-{host.name}", str(host.memory)], capture_output=True, text=True)
            if result.returncode != 0:
                break
            self._mounted.append(host.memory)
        else:
            return
        self.memory_is_tmpfs = False
        for mounted in self._mounted:
            subprocess.run(["umount", "--lazy", str(mounted)], capture_output=True)
        self._mounted.clear()
        for host in self.hosts:
            folder = Path(tempfile.mkdtemp(prefix=f"ckptfmt-{host.name}-", dir="/dev/shm"))
            self._shm_folders.append(folder)
            if host.memory.is_dir():
                host.memory.rmdir()
            host.memory.symlink_to(folder, target_is_directory=True)

    def _namespace(self, name: str) -> None:
        result = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
        if result.returncode != 0:
            raise HostsUnavailable(f"ip netns add {name}: {result.stderr.strip()}")
        self._made.append(name)

    def _ip(self, namespace: str, *args: str) -> None:
        result = subprocess.run(["ip", "-n", namespace, *args], capture_output=True, text=True)
        if result.returncode != 0:
            raise HostsUnavailable(f"ip -n {namespace} {' '.join(args)}: {result.stderr.strip()}")

    # -- running on a host -------------------------------------------------------------------------
    def command(self, host: Host, argv: list[str]) -> list[str]:
        """``argv`` as run on ``host``: in its network namespace, with its hostname, its local disk at
        ``self.local``, its memory at ``self.memory`` and the hosts' names in /etc/hosts."""
        setup = (f"hostname {host.name} && mount --bind {host.disk} {self.local} && "
                 f"mount --bind {host.memory} {self.memory} && "
                 f"mount --bind {self._hosts_file} /etc/hosts && exec \"$@\"")
        return ["ip", "netns", "exec", host.namespace, "unshare", "--uts", "--mount", "--propagation", "private",
                "sh", "-c", setup, "sh", *argv]

    def start_on(self, host: Host, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        return subprocess.Popen(self.command(host, argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=env, start_new_session=True)

    def torchrun(self, script: str, ranks_per_host: int, *args: str, timeout: float = 180,
                 env: dict[str, dict[str, str]] | None = None, check: bool = True) -> list[subprocess.CompletedProcess]:
        """tests/scripts/``script`` on every host under ``torchrun --nnodes``, ``ranks_per_host`` ranks each
        (gloo over ``eth0``); each host's result. ``env``: host name -> variables for its processes only.
        A launch past ``timeout`` is killed and fails the test; ``check=False`` returns failed launches
        (a node killed on purpose) instead."""
        markers.require("distributed")
        processes = []
        for index, host in enumerate(self.hosts):
            argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(len(self.hosts)),
                    "--node_rank", str(index), "--nproc_per_node", str(ranks_per_host),
                    "--master_addr", self.hosts[0].address, "--master_port", str(MASTER_PORT),
                    str(SCRIPTS / script), *args]
            variables = {**script_env(), "GLOO_SOCKET_IFNAME": "eth0", **(env or {}).get(host.name, {})}
            processes.append(self.start_on(host, argv, variables))
        results = [_finish(process, timeout) for process in processes]
        for host, result in zip(self.hosts, results):
            assert "(killed after" not in result.stderr, f"{script} on {host.name} hung:\n{result.stderr[-3000:]}"
            if not check:
                continue
            assert result.returncode == 0, \
                f"{script} on {host.name}: exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
            assert_groups_released(script, result.stderr)
        return results


def _finish(process: subprocess.Popen, timeout: float) -> subprocess.CompletedProcess:
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, err = process.communicate()
        err += f"\n(killed after {timeout} s)"
        return subprocess.CompletedProcess(process.args, -9, out, err)
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)
